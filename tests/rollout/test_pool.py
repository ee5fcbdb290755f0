"""RolloutPool on a simulated engine: batching, filtering, back-pressure, errors, stats."""

from __future__ import annotations

import threading
import time

import pytest

from megarl.api import RolloutWorkflow
from megarl.config.rollout import InferenceEngineConfig
from megarl.rollout import RolloutError, RolloutPool
from megarl.utils import stats_tracker
from megarl.workflow import workflow_context
from tests.rollout.sim import ListLoader, SimEngine, SimWorkflow, sim_items


@pytest.fixture
def pool_factory():
    pools = []

    def make(batch_size=4, engine=None, **config):
        engine = engine or SimEngine()
        pool = RolloutPool(engine, InferenceEngineConfig(**config), batch_size).start()
        pools.append(pool)
        return pool, engine

    yield make
    for pool in pools:
        pool.destroy()


def test_prepare_batch_exact_size_with_half_rejected(pool_factory):
    pool, engine = pool_factory(batch_size=8, max_concurrent_rollouts=8, max_staleness=1)
    loader = ListLoader(sim_items(200, seed=1, slow_p=0.0), batch_size=8)
    keep_even = lambda traj: int(traj["rewards"][0]) % 2 == 0
    seen = []
    for _ in range(3):
        batch = pool.prepare_batch(loader, SimWorkflow(), should_accept_fn=keep_even)
        ids = [int(r) for r in batch["rewards"]]
        assert len(ids) == 8 and all(i % 2 == 0 for i in ids)
        seen += ids
        engine.version += 1
        pool.notify_version()
    assert len(set(seen)) == len(seen), "a trajectory was handed out twice"
    stats = pool.staleness.get_stats()
    assert stats.rejected >= 20  # about half of what finished


def test_prepare_batch_pads_and_concatenates(pool_factory):
    pool, _ = pool_factory(batch_size=3, max_staleness=0)  # exactly one batch of episodes may start
    items = [{"id": i, "chunk_delays": [0.001] * (1 + 2 * i)} for i in range(3)]
    batch = pool.prepare_batch(ListLoader(items, 3), SimWorkflow())
    lengths = batch["attention_mask"].sum(1).tolist()
    assert batch["input_ids"].shape == (3, 2 + 5) and sorted(lengths) == [3, 5, 7]
    for row, reward in enumerate(batch["rewards"].tolist()):
        assert lengths[row] == 2 + 1 + 2 * int(reward)
    for row in range(3):
        n = lengths[row]
        assert batch["versions"][row, n:].eq(-1).all() and batch["loss_mask"][row, n:].eq(0).all()
        assert batch["versions"][row, :2].eq(-1).all() and batch["loss_mask"][row, 2:n].eq(1).all()


def test_rollout_batch_keeps_item_order_and_drops_rejected(pool_factory):
    pool, _ = pool_factory(batch_size=6, max_concurrent_rollouts=6)
    items = [{"id": i, "chunk_delays": [0.02 - 0.003 * i], "reject": i == 2} for i in range(6)]
    batch = pool.rollout_batch(items, SimWorkflow())
    assert batch["rewards"].tolist() == [0.0, 1.0, 3.0, 4.0, 5.0]


def test_rollout_batch_beyond_staleness_budget_is_an_error(pool_factory):
    pool, _ = pool_factory(batch_size=2, max_staleness=0)
    with pytest.raises(ValueError, match="staleness budget"):
        pool.rollout_batch([{"id": i, "chunk_delays": [0.0]} for i in range(3)], SimWorkflow())
    assert pool.rollout_batch([{"id": 0, "chunk_delays": [0.0]}], SimWorkflow(), is_eval=True)["rewards"].numel() == 1


def test_group_size_runs_workflow_n_times(pool_factory):
    pool, _ = pool_factory(batch_size=2)
    batch = pool.rollout_batch([{"id": 7, "chunk_delays": [0.001]}], SimWorkflow(), group_size=3)
    assert batch["rewards"].tolist() == [7.0, 7.0, 7.0]


def test_full_input_queue_is_back_pressure(pool_factory):
    pool, _ = pool_factory(batch_size=2, max_concurrent_rollouts=1, queue_size=2)
    pool.pause()
    for i in range(2):
        pool.submit({"id": i, "chunk_delays": [0.0]}, SimWorkflow())
    with pytest.raises(TimeoutError, match="input queue stayed full"):
        pool.submit({"id": 2, "chunk_delays": [0.0]}, SimWorkflow(), timeout=0.2)
    unblocked = threading.Event()

    def submit_blocking():
        pool.submit({"id": 2, "chunk_delays": [0.0]}, SimWorkflow())
        unblocked.set()

    thread = threading.Thread(target=submit_blocking)
    thread.start()
    time.sleep(0.1)
    assert not unblocked.is_set(), "submit must wait while the queue is full"
    pool.resume()
    thread.join(5)
    assert unblocked.is_set()
    assert len(pool.wait(2, timeout=5)) == 2  # the staleness budget (k=1, bs=2 → 4) admits all three
    assert len(pool.wait(1, timeout=5)) == 1


def test_batches_larger_than_the_queue_bound_complete(pool_factory):
    """The output bound is back-pressure for producers, never a deadlock for a consumer asking for more."""
    pool, _ = pool_factory(batch_size=2, max_concurrent_rollouts=2, queue_size=3, max_staleness=100)
    batch = pool.rollout_batch([{"id": i, "chunk_delays": [0.001]} for i in range(10)], SimWorkflow())
    assert batch["rewards"].tolist() == [float(i) for i in range(10)]
    submitter = threading.Thread(
        target=lambda: [pool.submit({"id": i, "chunk_delays": [0.0]}, SimWorkflow()) for i in range(8)]
    )
    submitter.start()
    assert len(pool.wait(8, timeout=10)) == 8
    submitter.join(5)


def test_wait_timeout_keeps_partial_results(pool_factory):
    pool, _ = pool_factory(batch_size=2)
    pool.submit({"id": 0, "chunk_delays": [0.0]}, SimWorkflow())
    with pytest.raises(TimeoutError, match="only 1 of 2"):
        pool.wait(2, timeout=0.5)
    assert len(pool.wait(1, timeout=1)) == 1


def test_wait_fails_at_once_when_stale_drops_leave_too_few(pool_factory, caplog):
    """An AReaL user's loop: submit, bump the version several times, wait. The trajectories are
    too old to train on; wait() must say so now, not after its timeout."""
    pool, engine = pool_factory(batch_size=2, max_staleness=1)
    for i in range(2):
        pool.submit({"id": i, "chunk_delays": [0.0]}, SimWorkflow())
    deadline = time.monotonic() + 10
    while len(pool._results) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.version = 3  # versions >= 2 are accepted; both trajectories are of version 0
    pool.notify_version()
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="megarl.rollout.pool"), stats_tracker.scope("t_stale"):
        with pytest.raises(RolloutError, match=r"2 trajectories were dropped as stale .*version\(s\) \[0\].*"
                                               r"max_staleness=1 accepts version 2 or newer.*only 0 of the 2"):
            pool.wait(2, timeout=30)
    assert time.monotonic() - start < 1
    assert sum("dropped a stale trajectory of version 0" in r.getMessage() for r in caplog.records) == 2
    assert stats_tracker.export(local=True)["t_stale/rollout/n_stale_dropped"] == 2  # counted in the caller's scope


def test_wait_for_episodes_still_to_come_is_not_cut_short_by_a_stale_drop(pool_factory):
    pool, engine = pool_factory(batch_size=2, max_staleness=1)
    pool.submit({"id": 0, "chunk_delays": [0.0]}, SimWorkflow())
    deadline = time.monotonic() + 10
    while len(pool._results) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.version = 2
    pool.notify_version()
    for i in (1, 2):  # new episodes at the new version: two can still arrive
        pool.submit({"id": i, "chunk_delays": [0.05]}, SimWorkflow())
    assert sorted(int(t["rewards"][0]) for t in pool.wait(2, timeout=10)) == [1, 2]


class _Boom(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        raise KeyError("answer")


def test_workflow_exception_surfaces_in_wait(pool_factory):
    pool, _ = pool_factory(batch_size=1)
    pool.submit({"id": 0}, _Boom())
    with pytest.raises(RolloutError, match="_Boom failed on task") as info:
        pool.wait(1, timeout=5)
    assert isinstance(info.value.__cause__, KeyError)
    assert pool.staleness.get_stats().running == 0


class _ContextProbe(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        ctx = workflow_context.get()
        stats_tracker.scalar(probe=1.0)
        traj = await SimWorkflow().arun_episode(engine, {"id": ctx.task_id, "chunk_delays": [0.001]})
        traj["is_eval"] = [ctx.is_eval]
        traj["scope"] = [workflow_context.stat_scope()]
        return traj


def test_workflow_context_and_stats(pool_factory):
    pool, _ = pool_factory(batch_size=2)
    stats_tracker.export(local=True)  # start clean
    train = pool.rollout_batch([{"id": 0}, {"id": 1}], _ContextProbe())
    evals = pool.rollout_batch([{"id": 0}], _ContextProbe(), is_eval=True)
    assert train["is_eval"] == [False, False] and train["scope"] == ["rollout", "rollout"]
    assert evals["is_eval"] == [True] and evals["scope"] == ["eval-rollout"]
    assert len(set(train["rewards"].tolist())) == 2  # distinct task ids
    stats = stats_tracker.export(local=True)
    assert stats["rollout/probe"] == 1.0 and stats["eval-rollout/probe"] == 1.0
    assert stats["rollout/n_finished"] == 2 and stats["rollout/n_accepted"] == 2
    assert stats["rollout/staleness/avg"] == 0.0 and stats["rollout/staleness_hist/0"] == 2
    assert "rollout/input_queue_depth" in stats and "rollout/running" in stats


def test_throughput_recorded_by_prepare_batch(pool_factory):
    pool, _ = pool_factory(batch_size=2, max_staleness=4)
    loader = ListLoader(sim_items(20, seed=3, slow_p=0.0), 2)
    stats_tracker.export(local=True)
    for _ in range(2):
        pool.prepare_batch(loader, SimWorkflow())
    stats = stats_tracker.export(local=True)
    assert stats["rollout/throughput_tokens_per_s"] > 0 and stats["rollout/throughput_trajs_per_s"] > 0
    assert 0 < stats["rollout/accepted"] <= 1


def test_prepare_batch_needs_batch_size(pool_factory):
    pool, _ = pool_factory(batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        pool.prepare_batch([[{"id": 0}]], SimWorkflow())


def test_queue_size_smaller_than_batch_is_rejected():
    with pytest.raises(ValueError, match="queue_size=2 is smaller than the batch size 4"):
        RolloutPool(SimEngine(), InferenceEngineConfig(queue_size=2), 4)


def test_submit_before_start_is_an_error():
    pool = RolloutPool(SimEngine(), InferenceEngineConfig(), 2)
    with pytest.raises(RuntimeError, match="not running"):
        pool.submit({"id": 0, "chunk_delays": [0.0]}, SimWorkflow())


def test_pending_items_make_a_recover_point_exact(pool_factory):
    """Items fed but not yet handed to the trainer are reported; resubmitting them loses and repeats nothing."""
    items = sim_items(64, seed=3, slow_p=0.3)
    pool, engine = pool_factory(batch_size=4, max_concurrent_rollouts=4, max_staleness=2)
    loader = ListLoader(items, 4)
    consumed = []
    for _ in range(3):
        consumed += [int(r) for r in pool.prepare_batch(loader, SimWorkflow())["rewards"]]
        engine.version += 1
        pool.notify_version()
    pending = pool.pending_items()
    assert pending, "with staleness 2 the pool runs ahead of the trainer"
    assert not {p["id"] for p in pending} & set(consumed)
    # everything fed so far is either consumed or pending: a recover point taken now loses nothing
    n_fed = len(consumed) + len(pending)
    assert {i["id"] for i in items[:n_fed]} == set(consumed) | {p["id"] for p in pending}

    fresh, fresh_engine = pool_factory(batch_size=4, max_concurrent_rollouts=4, max_staleness=2)
    fresh_engine.version = engine.version
    fresh.resubmit(engine.version, pending, SimWorkflow())
    rest = ListLoader(items[n_fed:], 4)  # the restored dataloader continues after the fed items
    after = []
    for _ in range(6):  # resubmitted items are queued first, so they finish within a few steps
        after += [int(r) for r in fresh.prepare_batch(rest, SimWorkflow())["rewards"]]
        fresh_engine.version += 1
        fresh.notify_version()
    assert {p["id"] for p in pending} <= set(after), "a pending prompt was never trained after recovery"
    assert len(set(consumed + after)) == len(consumed + after), "no prompt trained twice"


def test_a_recovered_pool_runs_ahead_by_the_staleness_bound_only(pool_factory):
    """Resumed at version 5, the pool may start (max_staleness + 1) batches, as the uninterrupted run
    could; counting from zero it would start 5 more, generated by version 5 and stale by the time
    the trainer got to them."""
    pool, engine = pool_factory(batch_size=4, max_concurrent_rollouts=64, max_staleness=1, queue_size=64)
    engine.version = 5
    pool.resubmit(5, [], SimWorkflow())
    loader = ListLoader(sim_items(64, seed=4, slow_p=0.0), 4)
    assert pool.prepare_batch(loader, SimWorkflow())["rewards"].numel() == 4
    deadline = time.monotonic() + 5
    while pool.staleness.get_stats().submitted < (1 + 1) * 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # room for the loop to start more, if the budget admitted more
    assert pool.staleness.get_stats().submitted == (1 + 1) * 4


def test_evaluation_larger_than_the_queue_finishes_while_training_prefetches(pool_factory):
    """An evaluation of many items between steps, while the fed training episodes keep running.

    Prefetched training trajectories fill the output side, and the fed training items the
    input queue; neither may keep evaluation episodes from starting: the trainer waits for
    the evaluation before it takes any training trajectory.
    """
    pool, engine = pool_factory(batch_size=4, max_concurrent_rollouts=4, max_staleness=1, queue_size=8)
    loader = ListLoader(sim_items(64, seed=5, slow_p=0.0), 4)
    pool.prepare_batch(loader, SimWorkflow())
    engine.version += 1  # the step's weight update: the budget opens for more prefetching
    pool.notify_version()
    pool.prepare_batch(loader, SimWorkflow())  # feeds the next batch, as the trainer does each step
    done = {}
    evaluation = sim_items(40, seed=7, slow_p=0.0)
    thread = threading.Thread(target=lambda: done.update(batch=pool.rollout_batch(evaluation, SimWorkflow(), is_eval=True)))
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "evaluation starved behind prefetched training episodes"
    assert done["batch"]["rewards"].numel() == 40
    assert pool.prepare_batch(loader, SimWorkflow())["rewards"].numel() == 4, "training goes on after evaluation"


def test_evaluation_passes_training_tasks_parked_at_the_staleness_bound(pool_factory):
    """The trainer evaluates between steps while prefetched training episodes wait for its next version."""
    pool, engine = pool_factory(batch_size=4, max_concurrent_rollouts=4, max_staleness=0)
    loader = ListLoader(sim_items(64, seed=5, slow_p=0.0), 4)
    pool.prepare_batch(loader, SimWorkflow())  # version 0's budget is spent ...
    for item in sim_items(4, seed=6, slow_p=0.0):  # ... so these training episodes park in the queue
        pool.submit(item, SimWorkflow())
    done = {}
    thread = threading.Thread(
        target=lambda: done.update(batch=pool.rollout_batch(sim_items(3, seed=7, slow_p=0.0), SimWorkflow(), is_eval=True))
    )
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "evaluation waited behind training tasks that need a new version"
    assert done["batch"]["rewards"].numel() == 3
    engine.version += 1
    pool.notify_version()
    assert len(pool.wait(4, timeout=30)) == 4, "the parked training episodes run once the version moves"
