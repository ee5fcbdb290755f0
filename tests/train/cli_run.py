"""``megarl run`` as a user types it, in a subprocess from the repository root (the e2e tests' one way in),
and what a run leaves to read: its console and ``metrics.jsonl``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARITHMETIC = "configs/arithmetic_grpo_cpu.yaml"
GSM8K = "configs/gsm8k_grpo_cpu.yaml"
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
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
"""What every e2e run sets: no hub, no dataset download, no wandb upload."""


def megarl_cmd(*args: str) -> list[str]:
    """The command line of ``megarl ARGS...`` (any subcommand) in this interpreter."""
    return [sys.executable, "-m", "megarl.launcher.cli", *args]


def megarl_env(**extra: str) -> dict[str, str]:
    """This process's environment, offline (:data:`OFFLINE`), with ``extra`` on top."""
    return {**os.environ, **OFFLINE, **extra}


def megarl(*args: str, expect: int = 0, timeout: float = 1500, env: dict[str, str] | None = None) -> str:
    """Run ``python -m megarl.launcher.cli ARGS...`` offline (``env``: more variables); its console (stdout + stderr).

    Fails the test, with the console's end, when the exit status is not ``expect``.
    """
    result = subprocess.run(
        megarl_cmd(*args), cwd=ROOT, env=megarl_env(**(env or {})), capture_output=True, text=True, timeout=timeout
    )
    console = result.stdout + result.stderr
    assert result.returncode == expect, f"exit status {result.returncode}, expected {expect}:\n{console[-5000:]}"
    return console


def megarl_run(*args: str, expect: int = 0, timeout: float = 1500, env: dict[str, str] | None = None) -> str:
    """Run ``megarl run ARGS...`` offline; its console (see :func:`megarl`)."""
    return megarl("run", *args, expect=expect, timeout=timeout, env=env)


def start_megarl(*args: str, env: dict[str, str] | None = None, **popen: object) -> subprocess.Popen:
    """Start ``megarl ARGS...`` offline in the background; its console (stdout and stderr together) is
    a text pipe unless ``popen`` says otherwise. The caller waits for it, or kills it."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen}
    return subprocess.Popen(megarl_cmd(*args), cwd=ROOT, env=megarl_env(**(env or {})), **popen)


def read_metrics(run_dir: Path) -> list[dict]:
    """The steps a run logged so far (``metrics.jsonl``, one dict per step); none before the first."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
