"""A short run of the pool's load benchmark (``benchmarks/pool_load.py``; 30 minutes and 512
episodes there): random delays and failures over real HTTP, every item accounted for."""

from __future__ import annotations

from benchmarks.pool_load import soak


def test_pool_under_random_faults_loses_and_doubles_nothing():
    row = soak(minutes=0.25, concurrency=64, fail_rate=0.1, delay_rate=0.05, max_delay=0.5)
    assert row["faults injected"] > 20 and row["steps"] >= 3, row
    assert row["lost"] == 0 and row["doubled"] == 0 and row["misaligned"] == 0, row
    assert row["drained"] and row["pending after drain"] == row["pending at end"], row
    assert row["loop tasks after drain"] <= 2, f"episode tasks leaked: {row}"
