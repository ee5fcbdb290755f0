"""Reward workers die with the process that started them, even when it is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
PARENT = """
import asyncio, os, sys, time
import psutil
from megarl.reward.executor import AsyncRewardWrapper
from tests.reward.test_gsm8k_reward import _quick_reward

if __name__ == "__main__":
    wrapper = AsyncRewardWrapper(_quick_reward, timeout_seconds=60, max_workers=2)
    asyncio.run(wrapper("p", "c", [], []))
    print(" ".join(str(c.pid) for c in psutil.Process().children(recursive=True)), flush=True)
    time.sleep(600)
"""


def test_killed_parent_leaves_no_reward_workers(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids, "the reward pool started no worker"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.5)
        assert not [p for p in pids if _alive(p)], "reward workers outlived their SIGKILLed parent"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
