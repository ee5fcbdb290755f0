"""``megarl run`` as a user types it, in a subprocess from the repository root (the e2e tests' one way in)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARITHMETIC = "configs/arithmetic_grpo_cpu.yaml"
QUIET_LOGGERS = ["stats_logger.wandb.mode=disabled", "stats_logger.tensorboard.enabled=false"]
SHORT_RUN = [  # two steps of two prompts x two samples, no evaluation or saving
    "total_train_steps=2",
    "train_dataset.batch_size=2",
    "gconfig.n_samples=2",
    "gconfig.max_new_tokens=16",
    "valid_dataset=null",
    "saver.freq_steps=null",
    *QUIET_LOGGERS,
]


def megarl_run(*args: str, expect: int = 0, timeout: float = 1500) -> str:
    """Run ``python -m megarl.launcher.cli run ARGS...`` offline; its console (stdout + stderr).

    Fails the test, with the console's end, when the exit status is not ``expect``.
    """
    cmd = [sys.executable, "-m", "megarl.launcher.cli", "run", *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    console = result.stdout + result.stderr
    assert result.returncode == expect, f"exit status {result.returncode}, expected {expect}:\n{console[-5000:]}"
    return console
