"""A real multi-host Slurm cluster on one machine: one network namespace per node.

Each node is a network namespace (``ip netns``), with its own host name (a UTS namespace), its own address on a private bridge
(``10.77.0.0/24``; iproute2's veth pairs), its own ``slurmd`` (``-N nodeK``, its spool, pid and log
files by node name) and its own ``/etc/hosts`` (``/etc/netns/NS/hosts``, mounted over ``/etc/hosts`` in the
node's own mount namespace), so that a job step on ``node2`` resolves ``node3`` to that node's
address and nothing else. ``slurmctld`` and ``munged`` run in the root namespace on the bridge's
address; the file system is shared, as a cluster's shared storage is. Only the namespaces' own
addresses and loopback are ever contacted.

Needs root, iproute2, slurm-wlm and munge (:func:`available`). Everything is removed by :meth:`stop`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from megarl.utils.network import find_free_ports
from megarl.utils.process import terminate_process_tree
from tests.launcher.slurm_cluster import SlurmCluster
from tests.launcher.slurm_cluster import available as slurm_available

SUBNET = "10.77.0"
BRIDGE = "mrlbr0"
CONTROLLER_ADDR = f"{SUBNET}.1"


def available() -> str | None:
    """None when a multi-host cluster can be started here, else why not."""
    reason = slurm_available()
    if reason is None and shutil.which("ip") is None:
        reason = "iproute2 not installed (apt-get install iproute2)"
    if reason is None and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        reason = "network namespaces are not available here (ip netns list failed)"
    return reason


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


class NetnsSlurmCluster(SlurmCluster):
    """``n_nodes`` Slurm nodes ``node1..nodeN``, each a network namespace with address ``10.77.0.(10+K)``."""

    def __init__(self, root: Path, n_nodes: int = 3, cpus_per_node: int = 2):
        super().__init__(root)
        self.n_nodes, self.cpus_per_node = n_nodes, cpus_per_node
        tag = f"{os.getpid() % 10000}"
        self.nodes = [f"node{k}" for k in range(1, n_nodes + 1)]
        self.namespaces = {node: f"mrl{tag}-{node}" for node in self.nodes}
        self.addresses = {node: f"{SUBNET}.{10 + k}" for k, node in enumerate(self.nodes, 1)}

    # ------------------------------------------------------------------ network

    def _network(self) -> None:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{CONTROLLER_ADDR}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{addr} {node}\n" for node, addr in self.addresses.items())
        for k, node in enumerate(self.nodes, 1):
            ns, outer = self.namespaces[node], f"mrlv{os.getpid() % 10000}n{k}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", outer, "master", BRIDGE)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[node]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)

    def _teardown_network(self) -> None:
        for node in self.nodes:
            ns = self.namespaces[node]
            _ip("netns", "delete", ns, check=False)  # its veth end goes with it, and the peer too
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        _ip("link", "delete", BRIDGE, check=False)

    def exec_in(self, node: str, *cmd: str) -> list[str]:
        """``cmd`` run inside ``node``'s network namespace, with the node's ``/etc/hosts`` and host name.

        Not ``ip netns exec``: it remounts ``/sys`` and so hides the cgroup mounts slurmd needs.
        """
        hosts = Path("/etc/netns") / self.namespaces[node] / "hosts"
        inner = f'mount --bind {hosts} /etc/hosts && hostname {node} && exec "$@"'
        return [
            "nsenter",
            f"--net=/run/netns/{self.namespaces[node]}",
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            inner,
            "sh",
            *cmd,
        ]

    # ------------------------------------------------------------------ daemons

    def _write_config(self) -> None:
        super()._write_config()
        conf = (self.root / "slurm.conf").read_text()
        conf = conf.replace(f"SlurmctldHost={self.host}", f"SlurmctldHost={self.host}({CONTROLLER_ADDR})")
        conf = conf.replace(f"SlurmdSpoolDir={self.root}/spool", f"SlurmdSpoolDir={self.root}/spool/%n")
        conf = conf.replace(f"SlurmdPidFile={self.root}/slurmd.pid", f"SlurmdPidFile={self.root}/slurmd-%n.pid")
        conf = conf.replace(f"SlurmdLogFile={self.root}/slurmd.log", f"SlurmdLogFile={self.root}/slurmd-%n.log")
        conf += "SlurmdTimeout=30\n"  # a lost node is declared down within half a minute
        node_line = next(line for line in conf.splitlines() if line.startswith("NodeName="))
        nodes = "\n".join(
            f"NodeName={node} NodeAddr={addr} NodeHostname={node} CPUs={self.cpus_per_node} State=UNKNOWN"
            for node, addr in self.addresses.items()
        )
        conf = conf.replace(node_line, nodes)
        (self.root / "slurm.conf").write_text(conf)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)

    def start(self, timeout: float = 60.0) -> NetnsSlurmCluster:
        self._network()
        try:
            self._write_config()
            self._start_munge()
            subprocess.run(["slurmctld", "-c"], check=True, env=self.env)
            self.pids["slurmctld"] = self._pid("slurmctld.pid", timeout)
            for node in self.nodes:
                self.start_node(node, timeout)
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        subprocess.run(
            [
                "munged",
                "--force",
                f"--key-file={munge / 'munge.key'}",
                f"--socket={munge / 'munge.socket'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            check=True,
            env=self.env,
        )
        self.pids["munged"] = int((munge / "munged.pid").read_text())

    def start_node(self, node: str, timeout: float = 60.0) -> None:
        """(Re)start ``node``'s slurmd inside its namespace."""
        pid_file = self.root / f"slurmd-{node}.pid"
        pid_file.unlink(missing_ok=True)
        subprocess.run(self.exec_in(node, "slurmd", "-N", node), check=True, env=self.env)
        self.pids[f"slurmd-{node}"] = self._pid(pid_file.name, timeout)

    def kill_node(self, node: str) -> None:
        """SIGKILL ``node``'s slurmd and every process in its namespace (a node lost)."""
        pids = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True).stdout
        for pid in map(int, pids.split()):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.pids.pop(f"slurmd-{node}", None)

    def kill_in_node(self, node: str, pattern: str) -> list[int]:
        """SIGKILL the processes in ``node``'s namespace whose command line holds ``pattern``; their pids."""
        import psutil

        pids = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True).stdout
        killed = []
        for pid in map(int, pids.split()):
            try:
                if pattern in " ".join(psutil.Process(pid).cmdline()):
                    os.kill(pid, 9)
                    killed.append(pid)
            except (psutil.Error, ProcessLookupError):
                pass
        return killed

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env
            ).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if set(states) == set(self.nodes) and all(s in ("idle", "mix", "alloc") for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not idle (sinfo: {states}); logs:\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        parts = []
        names = ["slurmctld.log", "munge/munged.log"] + [f"slurmd-{node}.log" for node in self.nodes]
        for name in names:
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(parts)

    def stop(self) -> None:
        if "slurmctld" in self.pids:
            try:
                self.cancel_all()
            except Exception:  # noqa: BLE001 -- tear down whatever state the cluster is in
                pass
        for node in self.nodes:
            self.kill_node(node)
        for name in ("slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is not None:
                terminate_process_tree(pid, timeout=10)
        self._teardown_network()


__all__ = ["NetnsSlurmCluster", "available", "find_free_ports"]
