"""GRPO learning, measured: ``configs/arithmetic_grpo_cpu.yaml`` run end to end (the real stack).

The run that ``tests/train/test_learning.py`` asserts on (+0.15 reward, last 5 steps vs
first 5, within 40 steps and 20 minutes), kept as a table: per step the batch reward,
completion length, the sequences the update left out (``actor.skip_zero_advantage``: groups
whose samples all scored the same), the step time and any evaluation; the summary above the
table gives the gain and the wall time. The curve is copied to ``learning_arithmetic.png``.
``--quick`` runs 6 steps.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import RESULTS_DIR, main_for

TITLE = "GRPO learning check: arithmetic, SmolLM2-135M-Instruct, CPU (configs/arithmetic_grpo_cpu.yaml)"
ROOT = Path(__file__).resolve().parents[1]
COLUMNS = {"reward": "batch/reward/avg", "completion tokens": "rollout/completion_len",
           "skipped seqs": "ppo_actor/skipped_seqs", "step s": "timeperf/step", "eval pass@1": "eval/pass@1"}  # fmt: skip
_wall_minutes: float | None = None


def run_arithmetic(overrides: list[str], curve: Path | None = None) -> tuple[list[dict], float]:
    """``megarl run configs/arithmetic_grpo_cpu.yaml *overrides``: its metrics per step and wall minutes.

    ``curve``: where to copy the run's ``curves.png``.
    """
    with tempfile.TemporaryDirectory(prefix="megarl_learning_") as tmp:
        cmd = [sys.executable, "-m", "megarl.launcher.cli", "run", str(ROOT / "configs" / "arithmetic_grpo_cpu.yaml"),
               f"cluster.fileroot={tmp}", "stats_logger.wandb.mode=disabled", *overrides]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
        start = time.monotonic()
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        minutes = (time.monotonic() - start) / 60
        if result.returncode != 0:
            raise RuntimeError(f"megarl run {' '.join(overrides)} failed:\n{(result.stdout + result.stderr)[-4000:]}")
        run_dir = Path(tmp) / "arithmetic-grpo-cpu" / "trial0"
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if curve is not None:
            shutil.copyfile(run_dir / "curves.png", curve)
    return metrics, minutes


def run(quick: bool) -> list[dict]:
    global _wall_minutes
    overrides = ["total_train_steps=6"] if quick else []
    metrics, _wall_minutes = run_arithmetic(overrides, None if quick else RESULTS_DIR / "learning_arithmetic.png")
    return [{"step": i, **{label: m.get(key) for label, key in COLUMNS.items()}} for i, m in enumerate(metrics)]


def reward_gain(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first 5 steps and of the last 5 (the learning bar compares them)."""
    return statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])


def summary(rows: list[dict]) -> str:
    """The gain the learning test asks for, and the wall time of the whole run (servers included)."""
    first, last = reward_gain([r["reward"] for r in rows])
    wall = f"; wall time {_wall_minutes:.1f} min" if _wall_minutes is not None else ""
    return (f"first 5 steps mean reward {first:.3f}, last 5 {last:.3f}, gain {last - first:+.3f} "
            f"over {len(rows)} steps{wall} (bar: +0.15 within 40 steps and 20 min)")  # fmt: skip


if __name__ == "__main__":
    main_for(__name__)
