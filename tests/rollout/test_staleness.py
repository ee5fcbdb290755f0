"""Staleness control: the capacity formula, and the bound over randomized schedules (no server)."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megarl.config.rollout import InferenceEngineConfig
from megarl.rollout import RolloutError, RolloutPool, StalenessManager
from tests.rollout.sim import ListLoader, SimEngine, SimWorkflow, sim_items


def test_capacity_formula():
    m = StalenessManager(max_concurrent_rollouts=8, consumer_batch_size=4, max_staleness=1)
    assert m.get_capacity(0) == 8  # min(8 - 0, 2 * 4 - 0)
    for _ in range(6):
        m.on_rollout_submitted()
    assert m.get_capacity(0) == 2  # min(8 - 6, 8 - 6)
    for _ in range(4):
        m.on_rollout_accepted()
    assert m.get_capacity(0) == 2  # min(8 - 2, 8 - (4 + 2))
    assert m.get_capacity(1) == 6  # min(8 - 2, 12 - 6)
    m.on_rollout_rejected()
    assert m.get_capacity(0) == 3
    m.on_rollout_dropped()
    assert m.get_stats().accepted == 3 and m.get_stats().dropped == 1
    assert m.get_capacity(0) == 4


def test_synchronous_when_max_staleness_zero():
    m = StalenessManager(max_concurrent_rollouts=100, consumer_batch_size=4, max_staleness=0)
    assert m.get_capacity(0) == 4
    for _ in range(4):
        m.on_rollout_submitted()
    assert m.get_capacity(0) == 0
    for _ in range(4):
        m.on_rollout_accepted()
    assert m.get_capacity(0) == 0 and m.get_capacity(1) == 4


@pytest.mark.parametrize("bad", [{"max_concurrent_rollouts": 0}, {"consumer_batch_size": 0}, {"max_staleness": -1}])
def test_bad_arguments(bad):
    kwargs = {"max_concurrent_rollouts": 2, "consumer_batch_size": 2, "max_staleness": 1} | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        StalenessManager(**kwargs)


def _run_schedule(max_staleness, batch_size, max_concurrent, steps, seed, reject_p, slow_p, pause_updates):
    engine = SimEngine()
    config = InferenceEngineConfig(max_concurrent_rollouts=max_concurrent, max_staleness=max_staleness)
    pool = RolloutPool(engine, config, batch_size).start()
    loader = ListLoader(sim_items(400, seed, reject_p, slow_p), batch_size)
    rng = random.Random(seed + 1)
    should_accept = lambda traj: True
    try:
        for step in range(steps):
            batch = pool.prepare_batch(loader, SimWorkflow(), should_accept)
            assert batch["rewards"].shape[0] == batch_size
            versions = batch["versions"]
            oldest = int(versions[versions >= 0].min())
            assert oldest >= engine.version - max_staleness, (
                f"step {step}: token of version {oldest} handed out at version {engine.version}, k={max_staleness}"
            )
            ids = batch["rewards"].tolist()
            assert len(set(ids)) == len(ids)
            time.sleep(rng.uniform(0, 0.01))  # "training"
            if pause_updates:
                pool.pause()
                engine.paused = True
            engine.version += 1
            pool.notify_version()
            if pause_updates:
                engine.paused = False
                pool.resume()
    finally:
        pool.destroy()
    return pool


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_staleness=st.integers(0, 3),
    batch_size=st.integers(1, 4),
    max_concurrent=st.integers(1, 8),
    steps=st.integers(2, 5),
    seed=st.integers(0, 10_000),
    reject_p=st.sampled_from([0.0, 0.3, 0.6]),
    slow_p=st.sampled_from([0.1, 0.3]),
    pause_updates=st.booleans(),
)
def test_no_accepted_token_older_than_bound(
    max_staleness, batch_size, max_concurrent, steps, seed, reject_p, slow_p, pause_updates
):
    _run_schedule(max_staleness, batch_size, max_concurrent, steps, seed, reject_p, slow_p, pause_updates)


def test_out_of_order_finishes_are_dropped_not_handed_out():
    """A long episode started at version 0 must not reach the trainer at version 2 with k=1."""
    engine = SimEngine()
    pool = RolloutPool(engine, InferenceEngineConfig(max_concurrent_rollouts=2, max_staleness=1), 1).start()
    slow = {"id": 0, "chunk_delays": [0.6]}
    try:
        pool.submit(slow, SimWorkflow())
        for version in range(3):
            pool.submit({"id": version + 1, "chunk_delays": [0.01]}, SimWorkflow())
            traj = pool.wait(1, timeout=10)[0]
            assert int(traj["rewards"][0]) == version + 1
            engine.version += 1
            pool.notify_version()
        time.sleep(0.8)  # the slow one is done now, but at version 3 its version-0 token is too old
        with pytest.raises(RolloutError, match="dropped as stale"):  # at once: nothing else can arrive
            pool.wait(1, timeout=30)
        assert pool.staleness.get_stats().dropped == 1
    finally:
        pool.destroy()
