"""Learning, measured: GRPO on small-number arithmetic with SmolLM2-135M on CPU (the real stack).

The acceptance bar: within 40 steps and 20 minutes, the mean reward of the last 5 steps
exceeds that of the first 5 by at least 0.15, also on a CPU without native bf16 (fp32 there).
The loss variants of ``benchmarks/learning_variants.py`` (rollout corrections) meet the same
bar in the same budget. ``make test-slow`` runs them; the curve lands in the run directory's
``curves.png``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.learning_variants import VARIANTS

ROOT = Path(__file__).resolve().parents[2]


COLOCATED = ["allocation_mode=vllm:d1t1|megatron:d1p1t1", "cluster.n_gpus_per_node=1"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_learns_arithmetic_within_40_steps_and_20_minutes(tmp_path, variant):
    learns_arithmetic(tmp_path, VARIANTS[variant])


@pytest.mark.slow
@pytest.mark.vllm
def test_colocated_learns_arithmetic_within_40_steps_and_20_minutes(tmp_path):
    """Server and trainer on one slot, the server asleep while the trainer computes (the same bar)."""
    run_dir = learns_arithmetic(tmp_path, COLOCATED)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("timeperf/sleep_servers" in step for step in steps), "the servers were not put to sleep each step"
    assert "POST /sleep?level=1&mode=abort" in (run_dir / "logs" / "server-0.log").read_text()


def learns_arithmetic(tmp_path: Path, overrides: list[str]) -> Path:
    """Run the arithmetic config with ``overrides`` and check the learning bar; returns the run directory."""
    cmd = [sys.executable, "-m", "megarl.launcher.cli", "run", str(ROOT / "configs" / "arithmetic_grpo_cpu.yaml"),
           f"cluster.fileroot={tmp_path}", "stats_logger.wandb.mode=disabled", *overrides]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30 * 60)
    minutes = (time.monotonic() - start) / 60
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    rewards = [json.loads(line)["batch/reward/avg"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"rewards per step: {[round(r, 3) for r in rewards]}; first 5 {first:.3f}, last 5 {last:.3f}; {minutes:.1f} min")
    assert 5 < len(rewards) <= 40, "the config must train more than 5 and at most 40 steps"
    assert 0.10 <= first <= 0.60, f"the task should start between 10% and 60% reward, got {first:.3f}"
    assert last - first >= 0.15, f"reward rose by only {last - first:.3f} (first 5 {first:.3f}, last 5 {last:.3f})"
    assert minutes <= 20, f"took {minutes:.1f} min"
    assert (run_dir / "curves.png").stat().st_size > 0
    return run_dir
