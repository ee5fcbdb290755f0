"""The rollout pool's thread runs no torch operation per episode (megarl.utils.host_tensors).

A dispatched torch operation releases the interpreter lock; on the pool's thread, beside a trainer
whose Python holds the lock, each one waits up to the switch interval (5 ms) to take it back. The
episode's trajectory (``make_trajectory``), its checks, its result and the pool's stats are made with
numpy and read with ``tolist`` instead: a dispatch mode on the pool's thread sees no operation.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.api import make_trajectory
from megarl.rollout.episodes import Result, Task
from megarl.utils import stats_tracker
from tests.rollout.conftest import make_engine
from tests.rollout.helpers import OneShotWorkflow

ALLOWED = {"aten.lift_fresh.default"}  # the no-op a tensor made from data passes through when a mode is on


class Ops(TorchDispatchMode):
    """The torch operations dispatched on the thread that entered it."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_episode_on_the_pool_runs_no_torch_operation(fake_servers):
    servers = fake_servers(2)
    engine = make_engine([s.address for s in servers], batch_size=8)
    ops = Ops()
    try:
        _on_loop(engine.pool.loop, ops.__enter__)
        batch = engine.rollout_batch([{"id": i} for i in range(8)], OneShotWorkflow())
        _on_loop(engine.pool.loop, lambda: ops.__exit__(None, None, None))
    finally:
        engine.destroy()
    assert batch["input_ids"].shape[0] == 8
    assert set(ops.seen) <= ALLOWED, f"torch operations on the pool's thread: {sorted(set(ops.seen) - ALLOWED)}"


def test_the_episode_paths_hold_the_lock_and_give_what_torch_would():
    """The same paths outside the pool (a mode on this thread), against torch's own operations."""
    with Ops() as ops:
        traj = make_trajectory([5, 6, 7], [8, 9], [-0.5, -0.25], [3, 2], 1.5)
        result = Result.of(Task(1, {}, None, None, is_eval=False), traj, 0, version=7)
        stats_tracker.get("pool_ops_test").denominator(n=torch.tensor([True, False, True]))
    assert set(ops.seen) <= ALLOWED, sorted(set(ops.seen) - ALLOWED)
    assert traj["input_ids"].tolist() == [[5, 6, 7, 8, 9]] and traj["input_ids"].dtype == torch.int32
    assert traj["attention_mask"].dtype == torch.bool and bool(traj["attention_mask"].all())
    assert traj["loss_mask"].tolist() == [[0, 0, 0, 1, 1]] and traj["rewards"].tolist() == [1.5]
    assert torch.equal(traj["logprobs"], torch.tensor([[0.0, 0.0, 0.0, -0.5, -0.25]]))
    assert result.oldest == 2 and result.n_tokens == 2  # the oldest generated token's version
    assert stats_tracker.get("pool_ops_test").export()["pool_ops_test/n"] == 2


def _on_loop(loop, fn) -> None:
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (fn(), done.set()))
    assert done.wait(10)
