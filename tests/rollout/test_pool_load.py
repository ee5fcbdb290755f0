"""A short run of the pool's load benchmark (``benchmarks/pool_load.py``; 30 minutes and 512
episodes there): random delays and failures over real HTTP, every item accounted for."""

from __future__ import annotations

import torch

from benchmarks.pool_load import soak
from megarl.utils import stats_tracker


def test_pool_under_random_faults_loses_and_doubles_nothing():
    # a count an earlier pool in this process recorded and nobody exported is not this run's
    with stats_tracker.scope("rollout"):
        stats_tracker.denominator(n_dropped_items=torch.ones(1, dtype=torch.bool))
    row = soak(minutes=0.25, concurrency=64, fail_rate=0.1, delay_rate=0.05, max_delay=0.5)
    assert row["faults injected"] > 20 and row["steps"] >= 3, row
    assert row["lost"] == 0 and row["doubled"] == 0 and row["misaligned"] == 0, row
    assert row["drained"] and row["pending after drain"] == row["pending at end"], row
    assert row["loop tasks after drain"] <= 2, f"episode tasks leaked: {row}"
