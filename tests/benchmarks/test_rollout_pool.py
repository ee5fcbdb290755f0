"""rollout_pool's client CPU: this process and its workers, never the server it measures against."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from benchmarks.rollout_pool import client_cpu_seconds

SPIN = 0.5
"""CPU seconds each child burns before it sleeps."""
CHILD = f"import time\nt = time.process_time()\nwhile time.process_time() - t < {SPIN}: pass\ntime.sleep(60)"


def test_client_cpu_counts_this_process_and_its_workers_but_not_the_server():
    server = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"]
    )
    worker = subprocess.Popen([sys.executable, "-c", CHILD])
    try:
        before = client_cpu_seconds(server.pid)
        server_tree = psutil.Process(server.pid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until both have burnt their CPU (the server's in its child)
            spinners = [psutil.Process(worker.pid), *server_tree.children()]
            if len(spinners) == 2 and all(sum(p.cpu_times()[:2]) >= SPIN for p in spinners):
                break
            time.sleep(0.1)
        used = client_cpu_seconds(server.pid) - before
    finally:
        for proc in (server, worker):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
    # the worker's SPIN (and what of its start-up came after `before`), not the server's second SPIN
    assert SPIN * 0.9 <= used < 2 * SPIN
