"""Start and drive a simulated cluster of N inference servers (``tests/scale/sim_host.py``).

``SERVERS_PER_PROCESS`` servers share one host process (its own event loop, one port each): 256
servers are 4 processes. Every server is a real HTTP endpoint; megarl's own code talks to them as
to vLLM or SGLang servers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megarl.utils.keeper import spawn, stop
from megarl.utils.network import find_free_ports
from tests.scale.sim_host import ServingModel, WeightLoad

SIM_HOST = Path(__file__).with_name("sim_host.py")
SERVERS_PER_PROCESS = 64
PORT_RANGE = (12000, 32000)
"""Where the simulated servers listen."""


@dataclass
class SimCluster:
    """N simulated servers; ``start()`` returns once all listen, ``stop()`` ends them."""

    n: int
    prompt_len: int
    dialect: str = "vllm"
    model_dir: str | None = None
    serving: ServingModel = field(default_factory=ServingModel)
    load: WeightLoad = field(default_factory=WeightLoad)
    per_process: int = SERVERS_PER_PROCESS
    addresses: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def start(self, timeout: float | None = None) -> SimCluster:
        """Start the host processes; returns once every one listens (``timeout``: seconds for all of them,
        by default 60 + 30 per process: 16 processes load their HF model together on a 2-core machine)."""
        # below Linux's ephemeral range (32768-60999 by default): the thousands of connections the pool and
        # the weight sync open take their local ports from that range while the hosts start
        ports = find_free_ports(self.n, port_range=PORT_RANGE)
        self.addresses = [f"127.0.0.1:{p}" for p in ports]
        for first in range(0, self.n, self.per_process):
            chunk = ports[first : first + self.per_process]
            self.processes.append(spawn(self._command(first, chunk), stdout=subprocess.PIPE, text=True))
        timeout = timeout if timeout is not None else 60.0 + 30.0 * len(self.processes)
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            line = proc.stdout.readline()  # "ready" once its ports listen
            late = time.monotonic() > deadline
            if line.strip() != "ready" or late:
                self.stop()
                why = f"not within {timeout:g} s" if late else f"it printed {line!r} (exit {proc.poll()})"
                raise RuntimeError(f"simulated host {proc.args[:8]}... did not start: {why}")
        return self

    def _command(self, first: int, ports: list[int]) -> list[str]:
        cmd = [sys.executable, str(SIM_HOST), "--ports", ",".join(map(str, ports)), "--first-index", str(first)]
        cmd += ["--dialect", self.dialect, "--prompt-len", str(self.prompt_len)]
        cmd += ["--model", self.model_dir] if self.model_dir else []
        flags = {**asdict(self.serving), **asdict(self.load)}
        flags["ttft"] = flags.pop("ttft_s")
        for name, value in flags.items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        return cmd

    def stats(self) -> list[dict]:
        """Every server's counters (one request per host process), in server order."""
        out = []
        for first in range(0, self.n, self.per_process):
            out += self._on_host(first, lambda address: _get(address, "/_host"))
        return out

    def _on_host(self, index: int, call):
        """``call(address)`` on the first server of server ``index``'s process that listens (a "dead" one does not)."""
        first = index - index % self.per_process
        for address in self.addresses[first : first + self.per_process]:
            try:
                return call(address)
            except OSError:
                continue
        raise RuntimeError(f"no server of the host process of server {index} answers")

    def fault(self, index: int, **what) -> None:
        """``die=True``, ``restart=True``, ``slow=F``, ``hang_update=True``, ``pause_delay=S``, ``receive_factor=F``
        or ``control_down=True`` on server ``index`` (see sim_host)."""
        self._on_host(index, lambda address: _post(address, "/_host/fault", {"index": index, **what}))

    def queue_faults(self, index: int, faults: list[str]) -> None:
        """The fake server's fault queue (e.g. ``["429"] * 20``): its next requests get them."""
        _post(self.addresses[index], "/_faults", {"faults": faults})

    def stop(self) -> None:
        for proc in self.processes:
            stop(proc, timeout=5)
        self.processes.clear()

    def __enter__(self) -> SimCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _get(address: str, route: str):
    with urllib.request.urlopen(f"http://{address}{route}", timeout=60) as reply:
        return json.loads(reply.read())


def _post(address: str, route: str, body: dict):
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{address}{route}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())
