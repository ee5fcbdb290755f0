"""The main-job and matmul benchmarks whose figures the README and quickstart quote."""

from __future__ import annotations

import pytest

from benchmarks import bf16_matmul, main_job


def test_a_step_row_reads_the_step_metrics():
    metrics = {
        "timeperf/step": 12.5,
        "timeperf/rollout": 9.0,
        "timeperf/train_step": 2.5,
        "timeperf/update_weights": 1.0,
        "batch/reward/avg": 0.25,
        "memory/rollout_peak_gb": 1.7,
        "memory/train_step_peak_gb": 3.0,
        main_job.GAP: 1.2e-5,
    }
    row = main_job.step_row(metrics, 0)
    assert row == {
        "kind": "step",
        "step": 1,
        "step s": 12.5,
        "rollout s": 9.0,
        "recompute s": 0.0,  # absent: the update's forward gave the proximal logprobs
        "update s": 2.5,
        "sync s": 1.0,
        "reward": 0.25,
        "gap nats": 1.2e-5,
        "peak RSS GB": 3.0,
    }
    # a step whose groups all scored the same trains nothing: no gap measured, no update peak
    assert main_job.step_row({"timeperf/step": 9.0}, 3)["gap nats"] is None


def test_the_matmul_benchmark_compares_bf16_with_fp32():
    rows = bf16_matmul.run(quick=True)
    assert [r["dtype"] for r in rows] == ["fp32", "bf16"]
    assert all(r["GFLOP/s"] > 0 for r in rows)
    assert rows[0]["vs fp32"] == pytest.approx(1.0)
    assert bf16_matmul.summary([{"GFLOP/s": 100.0}, {"GFLOP/s": 1.0}]) == "bf16 is 100.0x slower than fp32 here"
    assert bf16_matmul.summary([{"GFLOP/s": 100.0}, {"GFLOP/s": 400.0}]) == "bf16 is 4.0x faster"
