"""A real one-node Slurm cluster (slurm-wlm + munge) started in a temporary directory.

Everything lives under the directory: slurm.conf (pointed to by ``SLURM_CONF``),
the munge key and socket, state, spool, pid and log files. Daemons are stopped by
pid afterwards. Needs root and the Debian packages ``slurm-wlm`` and ``munge``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from megarl.utils.network import find_free_ports
from megarl.utils.process import terminate_process_tree

DAEMONS = ("munged", "slurmctld", "slurmd")
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
)


def available() -> str | None:
    """None when a cluster can be started here, else why not."""
    missing = [d for d in DAEMONS + ("sbatch", "scontrol") if shutil.which(d) is None]
    if missing:
        return f"slurm-wlm/munge not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "starting slurmd needs root"
    return None


class SlurmCluster:
    """Start with :meth:`start`, stop with :meth:`stop`; :attr:`env` is what clients need."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname()
        self.pids: dict[str, int] = {}
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def _write_config(self) -> None:
        for sub in ("state", "spool", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        ctld_port, d_port = find_free_ports(2)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        conf = f"""
ClusterName=megarltest
SlurmctldHost={self.host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.root}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd.log
SchedulerType=sched/backfill
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName={self.host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        (self.root / "slurm.conf").write_text(conf)

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        self._write_config()
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
        subprocess.run(["slurmctld", "-c"], check=True, env=self.env)  # -c: no old state
        self.pids["slurmctld"] = self._pid("slurmctld.pid", timeout)
        subprocess.run(["slurmd"], check=True, env=self.env)
        self.pids["slurmd"] = self._pid("slurmd.pid", timeout)
        self._wait_idle(timeout)
        return self

    def _pid(self, name: str, timeout: float) -> int:
        path = self.root / name
        deadline = time.monotonic() + timeout
        while not path.exists() or not path.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} never appeared; logs:\n{self.logs()}")
            time.sleep(0.2)
        return int(path.read_text())

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=self.env).stdout
            if out.strip() in ("idle", "mix", "alloc"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"node not idle (sinfo: {out.strip()!r}); logs:\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munge/munged.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(parts)

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, ...); {} for an unknown job.

        No accounting daemon runs, so this (not ``sacct``) is where a job's fate is read;
        ended jobs stay known for ``MinJobAge`` seconds.
        """
        out = self.run("scontrol", "--oneliner", "show", "job", job_id, check=False).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_job(
        self, job_id: str, timeout: float, states: frozenset[str] = FINAL_STATES, poll: Callable[[], None] | None = None
    ) -> str:
        """Block until the job is in one of ``states`` (by default: ended); returns that state.

        ``poll`` is called about every second meanwhile (e.g. to watch the job's processes).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job(job_id).get("JobState", "")
            if state in states:
                return state
            if poll is not None:
                poll()
            time.sleep(1)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout}s; logs:\n{self.logs()}")

    def job_pids(self, job_id: str) -> list[int]:
        """Pids of the job's processes on this node, every step's (``scontrol listpids``)."""
        out = self.run("scontrol", "listpids", job_id, check=False).stdout
        return [int(line.split()[0]) for line in out.splitlines()[1:] if line.split() and line.split()[0].isdigit()]

    def requeue(self, job_id: str, timeout: float = 120.0) -> None:
        """Requeue a running job as a preemption would, and let it start again at once.

        Slurm holds a requeued job for two minutes (its EligibleTime); the hold is lifted
        once the job is PENDING (updating it while still COMPLETING fails the job).
        """
        self.run("scontrol", "requeue", job_id)
        self.wait_job(job_id, timeout, states=frozenset({"PENDING"}))
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def cancel_all(self, timeout: float = 60.0) -> None:
        """Cancel every job still known and wait until none runs (a stopped slurmd leaves steps behind)."""
        jobs = self.run("squeue", "--noheader", "--format=%i", check=False).stdout.split()
        if not jobs:
            return
        self.run("scancel", *jobs, check=False)
        for job_id in jobs:
            with contextlib.suppress(TimeoutError):
                self.wait_job(job_id, timeout)

    def stop(self) -> None:
        if "slurmctld" in self.pids:
            self.cancel_all()
        for name in reversed(DAEMONS):
            pid = self.pids.pop(name, None)
            if pid is not None:
                terminate_process_tree(pid, timeout=10)
