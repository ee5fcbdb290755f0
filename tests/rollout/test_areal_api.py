"""The rollout API called the way an AReaL user calls it (issue 17, item 6).

AReaL's scripts hand workflows around as ``"package.module.Class"`` strings with
``workflow_kwargs``, call ``rollout_batch`` for debugging, offline collection and
evaluation, without a training step between calls, and mix it with ``submit / wait``.
"""

from __future__ import annotations

import re

import pytest

from megarl.rollout import RemoteInferenceEngine
from tests.rollout.conftest import fast_config
from tests.rollout.sim import SimEngine, SimWorkflow

WORKFLOW = "tests.rollout.helpers.OneShotWorkflow"
KWARGS = {"max_new_tokens": 4}


@pytest.fixture
def areal_engine(fake_servers):
    """An engine set up as AReaL's tests do: concurrency in the config, no batch size passed."""
    (server,) = fake_servers(1)
    engine = RemoteInferenceEngine(fast_config(max_concurrent_rollouts=2)).initialize(server_addrs=[server.address])
    yield engine
    engine.destroy()


def test_string_workflow_path_in_submit_wait_and_rollout_batch(areal_engine):
    """submit/wait, then rollout_batch again and again at version 0, all with a string path.

    Each rollout_batch returns trajectories generated now, by the current weights; the
    staleness budget (how far asynchronous rollout may run ahead of training) must not
    refuse them (it did: "exceed the staleness budget" on the second call).
    """
    data = [{"id": i} for i in range(2)]
    for item in data:
        areal_engine.submit(item, workflow=WORKFLOW, workflow_kwargs=KWARGS)
    assert sorted(int(t["rewards"][0]) for t in areal_engine.wait(2, timeout=10)) == [0, 1]
    for _ in range(3):
        batch = areal_engine.rollout_batch(data, workflow=WORKFLOW, workflow_kwargs=KWARGS)
        assert batch["rewards"].tolist() == [0.0, 1.0]
    grouped = areal_engine.rollout_batch(data, workflow=WORKFLOW, workflow_kwargs=KWARGS, group_size=2)
    assert grouped["rewards"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert grouped["versions"][grouped["loss_mask"].bool()].eq(0).all()


def test_prepare_batch_takes_a_string_workflow_path(areal_engine):
    from tests.rollout.sim import ListLoader

    loader = ListLoader([{"id": i} for i in range(4)], batch_size=2)
    batch = areal_engine.prepare_batch(loader, workflow=WORKFLOW, workflow_kwargs=KWARGS)
    assert sorted(batch["rewards"].tolist()) == [0.0, 1.0]


def test_should_accept_fn_as_a_string_path(areal_engine):
    data = [{"id": i} for i in range(4)]
    batch = areal_engine.rollout_batch(
        data, workflow=WORKFLOW, workflow_kwargs=KWARGS, should_accept_fn="tests.rollout.test_areal_api.even_reward"
    )
    assert batch["rewards"].tolist() == [0.0, 2.0]


def even_reward(traj) -> bool:
    """A ``should_accept_fn`` an AReaL user names by its import path."""
    return int(traj["rewards"][0]) % 2 == 0


def test_areal_positional_order_is_caught_at_submit(areal_engine):
    """AReaL's order is (data, workflow, workflow_kwargs, ...); megarl's third argument is
    should_accept_fn. A kwargs dict there fails at once, saying what to write."""
    with pytest.raises(TypeError, match=r"should_accept_fn .* got dict.*workflow_kwargs="):
        areal_engine.rollout_batch([{"id": 0}], WORKFLOW, KWARGS)
    with pytest.raises(TypeError, match=r"should_accept_fn .* got dict"):
        areal_engine.submit({"id": 0}, WORKFLOW, KWARGS)


class _Decoder:
    """Enough of a tokenizer for the trajectory dumper."""

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_rollout_batch_is_eval(fake_servers, tmp_path):
    """``rollout_batch(..., is_eval=True)``: evaluation episodes, as AReaL marks them: their own
    stats scope and dump directory, outside the training stats and the staleness accounting."""
    from megarl.utils import stats_tracker

    (server,) = fake_servers(1)
    engine = RemoteInferenceEngine(fast_config(max_concurrent_rollouts=2, dump_trajectories=True))
    engine.initialize(server_addrs=[server.address], dump_dir=str(tmp_path), tokenizer=_Decoder())
    try:
        stats_tracker.export(local=True)  # start clean
        data = [{"id": i} for i in range(5)]
        batch = engine.rollout_batch(data, workflow=WORKFLOW, workflow_kwargs=KWARGS, is_eval=True)
        assert batch["rewards"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        stats = stats_tracker.export(local=True)
        assert stats["eval-rollout/n_finished"] == 5 and "rollout/n_finished" not in stats
        assert "rollout/staleness/avg" not in stats, "evaluation trajectories counted as training"
        assert len(list((tmp_path / "eval-rollout" / "0").glob("*.jsonl"))) == 5
        assert not (tmp_path / "rollout").exists()
        assert engine.pool.staleness.get_stats().submitted == 0
    finally:
        engine.destroy()


def test_data_parallel_heads_dump_each_episode_to_its_own_file(tmp_path, fake_servers):
    """Two data-parallel heads, each with its engine, dumping into one run directory: the task ids of
    one never repeat the other's, so no trajectory file holds two heads' episodes (they were both
    counted from 0 and appended to the same ``{task_id}.jsonl``)."""
    (server,) = fake_servers(1)
    engines = [RemoteInferenceEngine(fast_config(max_concurrent_rollouts=2, dump_trajectories=True)) for _ in range(2)]
    try:
        for index, engine in enumerate(engines):
            engine.initialize(
                server_addrs=[server.address], dump_dir=str(tmp_path), tokenizer=_Decoder(), head=(index, 2)
            )
        ids = [
            [engine.submit({"id": i}, workflow=WORKFLOW, workflow_kwargs=KWARGS) for i in range(3)]
            for engine in engines
        ]
        assert ids == [[0, 2, 4], [1, 3, 5]]
        for engine in engines:
            engine.wait(3, timeout=20)
        files = sorted((tmp_path / "rollout" / "0").glob("*.jsonl"))
        assert [p.stem for p in files] == ["0", "1", "2", "3", "4", "5"]
        assert all(len(p.read_text().splitlines()) == 1 for p in files)  # one episode of one row each
    finally:
        for engine in engines:
            engine.destroy()


@pytest.mark.parametrize("head", [(2, 2), (0, 0), (-1, 2)])
def test_a_head_outside_its_count_is_refused(head):
    with pytest.raises(ValueError, match=re.escape(f"head={head} is not (index, count)")):
        RemoteInferenceEngine(fast_config()).initialize(server_addrs=["127.0.0.1:1"], head=head)


def test_wait_raise_timeout_false_returns_empty(areal_engine):
    assert areal_engine.wait(1, timeout=0.2, raise_timeout=False) == []
    with pytest.raises(TimeoutError, match="only 0 of 1"):
        areal_engine.wait(1, timeout=0.2)


def test_rollout_batch_leaves_the_asynchronous_budget_alone():
    """After many rollout_batch calls at version 0, submitted episodes still start (pool level)."""
    from megarl.config.rollout import InferenceEngineConfig
    from megarl.rollout import RolloutPool

    pool = RolloutPool(SimEngine(), InferenceEngineConfig(max_staleness=0), batch_size=2).start()
    try:
        for _ in range(3):
            batch = pool.rollout_batch([{"id": i, "chunk_delays": [0.0]} for i in range(4)], SimWorkflow())
            assert batch["rewards"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert pool.staleness.get_stats().submitted == 0
        for i in range(2):
            pool.submit({"id": i, "chunk_delays": [0.0]}, SimWorkflow())
        assert len(pool.wait(2, timeout=10)) == 2
    finally:
        pool.destroy()


def test_a_failed_rollout_batch_leaves_no_error_behind():
    """Every episode of a failing rollout_batch fails; the next call must not see their errors."""
    from megarl.config.rollout import InferenceEngineConfig
    from megarl.rollout import RolloutError, RolloutPool

    pool = RolloutPool(SimEngine(), InferenceEngineConfig(), batch_size=4).start()
    try:
        with pytest.raises(RolloutError, match="failed on task"):
            pool.rollout_batch(
                [{"id": i, "chunk_delays": [0.01]} for i in range(4)],
                SimWorkflow(),
                should_accept_fn=lambda traj: 1 / 0,
            )
        batch = pool.rollout_batch([{"id": 7, "chunk_delays": [0.0]}], SimWorkflow())
        assert batch["rewards"].tolist() == [7.0]
        pool.submit({"id": 8, "chunk_delays": [0.0]}, SimWorkflow())
        assert int(pool.wait(1, timeout=10)[0]["rewards"][0]) == 8
    finally:
        pool.destroy()
