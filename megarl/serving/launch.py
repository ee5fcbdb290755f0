"""Starting inference servers, waiting for them to be healthy, and stopping them.

A server is a :class:`megarl.utils.children.Child` with its output in a log file: its whole
process tree (vLLM's engine core and TP workers included) goes away when the parent exits
however it does, and :meth:`InferenceServer.stop` also kills what a dead server left behind.
A server that dies before it is healthy raises :class:`ServerLaunchError` quoting the end of
its log.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from megarl.config.rollout import InferenceEngineConfig
from megarl.serving.http import http_ok
from megarl.utils.children import Child
from megarl.utils.network import format_host_port, parse_host_port

logger = logging.getLogger(__name__)

_LOG_TAIL_LINES = 40
_POLL_S = 0.5


class ServerLaunchError(RuntimeError):
    """A server exited, or was not healthy before its deadline."""


@dataclass
class LaunchSpec:
    """How to start one server: the command, extra environment, and where it will listen."""

    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 0
    health_endpoint: str = "/health"
    nice: int = 0
    """CPU priority below this process's (``nice``; Linux): the server's whole process tree runs at it."""
    scratch_env: tuple[str, ...] = ()
    """Environment variables that name where the server puts its sockets (vLLM's
    ``VLLM_RPC_BASE_PATH``): each is pointed at a directory of this server's own, removed when it stops,
    however it stops (unless its keeper is SIGKILLed with it). A variable already set in this process's
    environment is left as it is."""

    @property
    def address(self) -> str:
        return format_host_port(self.host, self.port)


class InferenceServer:
    """One launched server process (use as a context manager, or call ``stop``)."""

    def __init__(self, spec: LaunchSpec, log_path: str | os.PathLike | None = None, name: str = "server"):
        self.spec = spec
        self.name = name
        self.log_path = None if log_path is None else Path(log_path)
        """Where its output goes; without one, a temporary file made when it starts."""
        self.proc: Child | None = None

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def pid(self) -> int | None:
        """The server process's pid (``proc`` is its keeper, ``megarl.utils.keeper``), None before start."""
        return None if self.proc is None else self.proc.command_pid()

    def start(self) -> InferenceServer:
        """Launch the process (returns at once; see :meth:`wait_until_healthy`)."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name} at {self.address} was already started")
        if self.log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"megarl-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        scratch_env = [name for name in self.spec.scratch_env if name not in os.environ]
        scratch = tempfile.mkdtemp(prefix=f"megarl-{self.name}-") if scratch_env else None
        env.update(dict.fromkeys(scratch_env, scratch))
        logger.info("starting %s at %s (log %s): %s", self.name, self.address, self.log_path, " ".join(self.spec.cmd))
        with open(self.log_path, "ab") as log:
            self.proc = Child(
                self.spec.cmd,
                env,
                nice=self.spec.nice,
                scratch=scratch,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server's log."""
        if self.log_path is None:
            return f"({self.name} was not started: no log)"
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except OSError as e:
            return f"(log {self.log_path} unreadable: {e})"

    def is_healthy(self, timeout: float = 5.0) -> bool:
        """One health probe: whether the server answers 200 on its health endpoint."""
        return http_ok(self.address, self.spec.health_endpoint, timeout)

    def wait_until_healthy(self, timeout: float) -> None:
        """Block until healthy; ``ServerLaunchError`` (with the log tail) if it dies or the deadline passes."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerLaunchError(
                    f"{self.name} at {self.address} exited with code {code} before it was healthy; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self.is_healthy():
                logger.info("%s at %s is healthy", self.name, self.address)
                return
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise ServerLaunchError(
                    f"{self.name} at {self.address} was not healthy within {timeout:g}s; "
                    f"last lines of {self.log_path}:\n{tail}"
                )
            time.sleep(_POLL_S)

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate the server's whole process tree, or kill what it left if it died (idempotent)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            logger.info("stopping %s at %s", self.name, self.address)
        self.proc.stop(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_servers(
    specs: list[LaunchSpec], timeout: float, log_dir: str | os.PathLike | None = None, name: str = "server"
) -> list[InferenceServer]:
    """Start every server at once, then wait for all to be healthy (startups overlap).

    If any fails, all are stopped and the error is raised.
    """
    servers = []
    for i, spec in enumerate(specs):
        log_path = None if log_dir is None else Path(log_dir) / f"{name}-{i}.log"
        servers.append(InferenceServer(spec, log_path, name=f"{name}-{i}"))
    try:
        for server in servers:
            server.start()
        deadline = time.monotonic() + timeout
        for server in servers:
            server.wait_until_healthy(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


AREAL_SERVER_ADDRS_ENV = "AREAL_LLM_SERVER_ADDRS"
"""AReaL's variable for the server list: read when ``rollout.server_addrs_env``'s is unset or empty, so
servers started the AReaL way are found as they are."""


def env_server_addrs(config: InferenceEngineConfig) -> tuple[list[str], str]:
    """The server addresses in ``$config.server_addrs_env``, else in ``$AREAL_LLM_SERVER_ADDRS`` (empty when
    neither is set), and where they were read, for messages."""
    raw = ""
    for name in (config.server_addrs_env, AREAL_SERVER_ADDRS_ENV):
        raw = os.environ.get(name, "")
        if raw.strip():
            break
    return [a.strip() for a in raw.split(",") if a.strip()], f"${name}={raw!r}"


def resolve_server_addrs(config: InferenceEngineConfig) -> list[str]:
    """Server addresses from ``config.server_addrs``, else from the environment (:func:`env_server_addrs`)."""
    addrs = list(config.server_addrs)
    source = "rollout.server_addrs"
    if not addrs:
        addrs, source = env_server_addrs(config)
    if not addrs:
        raise ValueError(
            f"no inference servers: set rollout.server_addrs or ${config.server_addrs_env} (comma-separated "
            f"host:port; ${AREAL_SERVER_ADDRS_ENV} is read when it is unset)"
        )
    for addr in addrs:
        try:
            parse_host_port(addr)
        except ValueError as e:
            raise ValueError(f"bad inference server address in {source}: {e}") from None
    return addrs
