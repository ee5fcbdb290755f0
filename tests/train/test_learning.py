"""Learning, measured: GRPO on small-number arithmetic with SmolLM2-135M on CPU (the real stack).

Two bars:

* **both dtypes** (:func:`test_learns_arithmetic_in_15_steps`): fp32 and bf16, two seeds each,
  the mean reward of the last 5 of 15 steps at least 0.3 above that of the first 5. bf16 is what
  GPUs train in; on a CPU without native bf16 it is emulated (``actor.emulate_bf16``: bf16
  weights, activations and roundings, products in fp32; see ``benchmarks.learning_arithmetic.
  dtype_overrides``). With Megatron's round-to-nearest bf16 weight copy
  (``actor.optimizer.bf16_rounding=nearest``) bf16 gained +0.08 to +0.17 here where fp32 gained
  +0.4 to +0.5: this test is the guard against that.
* **the loss variants** of ``benchmarks/learning_variants.py`` (rollout corrections) and the
  colocated layout: +0.15 within 40 steps and 20 minutes, at the machine's ``dtype: auto``.

``make test-slow`` runs them; the curve lands in the run directory's ``curves.png``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from benchmarks.learning_arithmetic import GAIN_BAR, SEEDS, STEPS, dtype_overrides
from benchmarks.learning_variants import VARIANTS
from tests.train.cli_run import ARITHMETIC, megarl_run, read_metrics

COLOCATED = ["allocation_mode=vllm:d1t1|megatron:d1p1t1", "cluster.n_gpus_per_node=1"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_learns_arithmetic_in_15_steps(tmp_path, dtype, seed):
    """bf16 learns per step as fp32 does: +0.3 reward (first 5 vs last 5 steps) within 15 steps."""
    overrides = [*dtype_overrides(dtype), f"seed={seed}", f"total_train_steps={STEPS}"]
    learns_arithmetic(tmp_path, overrides, bar=GAIN_BAR, minutes=15)


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
    steps = read_metrics(run_dir)
    assert all("timeperf/sleep_servers" in step for step in steps), "the servers were not put to sleep each step"
    assert "POST /sleep?level=1&mode=abort" in (run_dir / "logs" / "server-0.log").read_text()


def learns_arithmetic(tmp_path: Path, overrides: list[str], bar: float = 0.15, minutes: float = 20) -> Path:
    """Run the arithmetic config with ``overrides`` and check the learning ``bar`` (reward gain,
    first 5 vs last 5 steps) and the time budget; returns the run directory."""
    start = time.monotonic()
    megarl_run(
        ARITHMETIC, f"cluster.fileroot={tmp_path}", "stats_logger.wandb.mode=disabled", *overrides, timeout=30 * 60
    )
    took = (time.monotonic() - start) / 60
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    rewards = [step["batch/reward/avg"] for step in read_metrics(run_dir)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"rewards per step: {[round(r, 3) for r in rewards]}; first 5 {first:.3f}, last 5 {last:.3f}; {took:.1f} min")
    assert 5 < len(rewards) <= 40, "the config must train more than 5 and at most 40 steps"
    assert 0.10 <= first <= 0.60, f"the task should start between 10% and 60% reward, got {first:.3f}"
    assert last - first >= bar, f"reward rose by only {last - first:.3f} (first 5 {first:.3f}, last 5 {last:.3f})"
    assert took <= minutes, f"took {took:.1f} min"
    assert (run_dir / "curves.png").stat().st_size > 0
    return run_dir
