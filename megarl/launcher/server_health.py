"""The launcher's servers while they start and while they serve: health, death, restart in their slot.

:class:`ServerStartup` waits for the servers' health (a server that exits first, or is not healthy
within its ``startup_timeout``, fails the run, quoting its log); then
:func:`check_servers` looks at every server the run started; a dead one is restarted by
:class:`ServerRestarts` within the run's budget (``launcher.server_restarts`` per server,
``launcher.max_server_restarts`` per run), else the run fails with a
:class:`~megarl.serving.launch.ServerLaunchError` that quotes the end of the server's log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from megarl.launcher.output import OutputRelay
from megarl.serving.launch import InferenceServer, ServerLaunchError
from megarl.serving.restarts import RESTARTS_FILE, append_record

logger = logging.getLogger(__name__)
POLL_S = 0.5
"""Seconds between two looks at the servers."""


def death_message(server: InferenceServer, when: str) -> str:
    """What a dead server's error says: its name, address, exit code, when, and its log's last lines."""
    return (
        f"{server.name} at {server.address} exited with code {server.proc.returncode} {when}; "
        f"last lines of {server.log_path}:\n{server.log_tail()}"
    )


def check_servers(servers: list[InferenceServer], when: str, restarts: ServerRestarts | None = None) -> None:
    """Restart a server that exited (``restarts``' budget allowing), else ``ServerLaunchError``."""
    for i, server in enumerate(servers):
        if server.proc.poll() is not None:
            if restarts is None:
                raise ServerLaunchError(death_message(server, when))
            servers[i] = restarts.restart(server, when)


class ServerRestarts:
    """Restarts dead servers in their slots within the budget (``launcher.server_restarts`` per server,
    ``launcher.max_server_restarts`` per run); each restart is a line of ``{run_dir}/server_restarts.jsonl``.

    The new process has the dead one's spec: same command, devices and port. What the dead one left
    (vLLM's engine core, its workers) is killed first: it may hold the port or the devices.
    """

    def __init__(self, per_server: int, per_run: int, run_dir: Path, relay: OutputRelay | None = None):
        self.per_server, self.per_run, self.relay = per_server, per_run, relay
        self.log = Path(run_dir) / RESTARTS_FILE
        self.counts: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def restart(self, server: InferenceServer, when: str) -> InferenceServer:
        """A started replacement of the exited ``server``; ``ServerLaunchError`` once the budget is spent."""
        message = death_message(server, when)
        spent = self._spent(server.name)
        if spent:
            raise ServerLaunchError(f"{message}\nnot restarted: {spent}")
        self.counts[server.name] = self.counts.get(server.name, 0) + 1
        n = self.counts[server.name]
        line = (
            f"{server.name} at {server.address} exited with code {server.proc.returncode} {when}; restarting it "
            f"in its slot (restart {n} of {self.per_server} for it, {self.total} of {self.per_run} this run)"
        )
        logger.warning("%s; last lines of %s:\n%s", line, server.log_path, server.log_tail(10))
        if self.relay is not None:
            self.relay.end_line()
            self.relay.line("megarl", line)
        server.stop()  # what the dead one left (vLLM's engine core, its workers) may hold the port or the devices
        with open(server.log_path, "ab") as f:
            f.write(f"# megarl: {line}\n".encode())
        replacement = InferenceServer(server.spec, server.log_path, name=server.name).start()
        append_record(
            self.log,
            {
                "time": time.time(),
                "server": server.name,
                "address": server.address,
                "exit_code": server.proc.returncode,
                "restart": n,
                "run_total": self.total,
            },
        )
        return replacement

    def _spent(self, name: str) -> str:
        if self.counts.get(name, 0) >= self.per_server:
            return f"launcher.server_restarts={self.per_server} restarts of {name} are spent"
        if self.total >= self.per_run:
            return f"launcher.max_server_restarts={self.per_run} restarts of this run are spent"
        return ""


def wait_healthy(servers: list[InferenceServer], timeout: float) -> None:
    """Wait until every server answers its health check; fail as soon as one exits."""
    startup = ServerStartup(servers, timeout)
    while not startup.poll():
        time.sleep(POLL_S)


class ServerStartup:
    """Servers on their way up, probed by whoever waits for them (the launcher's watch loop).

    The trainer starts with the servers, not after them: its imports, model build and
    weight loading (~15 s for the main job) overlap the servers' start-up, and its rollout
    engine waits for their health itself (``rollout.setup_timeout``).
    """

    def __init__(self, servers: list[InferenceServer], timeout: float, on_ready: Callable[[float], None] | None = None):
        self.waiting = list(servers)
        self.started = time.monotonic()
        self.timeout = timeout
        self.on_ready = on_ready

    def poll(self) -> bool:
        """Whether every server is healthy now; ``ServerLaunchError`` if one exited or the deadline passed."""
        for server in list(self.waiting):
            if server.proc.poll() is not None:
                raise ServerLaunchError(death_message(server, "before it was healthy"))
            if server.is_healthy(timeout=2.0):
                self.waiting.remove(server)
                if not self.waiting:
                    self._ready()
        if self.waiting and time.monotonic() - self.started > self.timeout:
            names = ", ".join(s.name for s in self.waiting)
            raise ServerLaunchError(
                f"{names} not healthy within {self.timeout:g} s (vllm/sglang.startup_timeout); "
                f"last lines of {self.waiting[0].log_path}:\n{self.waiting[0].log_tail()}"
            )
        return not self.waiting

    def _ready(self) -> None:
        seconds = time.monotonic() - self.started
        logger.info("servers healthy after %.1f s", seconds)
        if self.on_ready is not None:
            self.on_ready(seconds)
