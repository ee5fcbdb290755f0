"""Episodes that fail on the servers: counted, logged, run again or dropped, and the run goes on.

Real HTTP: the engine talks to the fault-injecting fake server (``fake_server.py``) in its own
process. What reaches the trainer is checked token by token against what the server generates,
so a half-finished or misaligned trajectory would fail the tests.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from megarl.rollout import RolloutError
from megarl.utils import stats_tracker
from tests.rollout.conftest import make_engine
from tests.rollout.helpers import OneShotWorkflow, expected_tokens
from tests.rollout.sim import ListLoader

PROMPT_LEN, NEW_TOKENS = 5, 12


def _inject(address: str, faults: list[str]) -> None:
    body = json.dumps({"faults": faults}).encode()
    urllib.request.urlopen(urllib.request.Request(f"http://{address}/_faults", data=body, method="POST"), timeout=10)


def _stats(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/_stats", timeout=10) as resp:
        return json.loads(resp.read())


def _assert_clean(batch: dict) -> None:
    """Every row is exactly what the server generates for its prompt: nothing lost, nothing spliced."""
    tokens, logprobs = expected_tokens(PROMPT_LEN, NEW_TOKENS)
    for row in range(batch["input_ids"].shape[0]):
        assert batch["input_ids"][row, PROMPT_LEN:].tolist() == tokens
        assert batch["logprobs"][row, PROMPT_LEN:].tolist() == pytest.approx(logprobs)
        assert batch["loss_mask"][row, PROMPT_LEN:].all() and not batch["loss_mask"][row, :PROMPT_LEN].any()


@pytest.fixture
def engine_on(fake_servers):
    engines = []

    def make(**config):
        (server,) = fake_servers(1)
        engine = make_engine([server.address], request_retries=1, request_timeout=2.0, **config)
        engines.append(engine)
        return engine, server.address

    yield make
    for engine in engines:
        engine.destroy()


def test_failed_episode_runs_again_and_is_counted(engine_on, caplog):
    """A request refused for good (HTTP 400) ends its episode; the episode runs again from scratch,
    the batch is whole and clean, and the step metrics count the failure by kind."""
    engine, address = engine_on(batch_size=4, max_concurrent_rollouts=1, episode_retries=1)
    _inject(address, ["400"])
    loader = ListLoader([{"id": i} for i in range(8)], batch_size=4)
    stats_tracker.export(local=True)  # start clean
    with caplog.at_level("WARNING", logger="megarl.rollout.pool"):
        batch = engine.prepare_batch(loader, OneShotWorkflow(NEW_TOKENS, PROMPT_LEN))
    stats = stats_tracker.export(local=True)
    assert sorted(int(r) for r in batch["rewards"]) == [0, 1, 2, 3], "the failed item was not run again"
    _assert_clean(batch)
    assert stats["rollout/n_failed"] == 1 and stats["rollout/failed/http_4xx"] == 1
    assert "rollout/n_dropped_items" not in stats
    assert "failed on the servers (http_4xx); running it again (attempt 2 of 2)" in caplog.text
    assert "HTTP 400" in caplog.text


def test_item_dropped_after_its_retries_and_the_batch_refilled(engine_on, caplog):
    """With no episode retries the failed item is dropped, logged and counted; the batch is refilled
    with the next items, and the dropped one is no longer pending for a recover point."""
    engine, address = engine_on(batch_size=4, max_concurrent_rollouts=1, episode_retries=0)
    _inject(address, ["400"])
    loader = ListLoader([{"id": i} for i in range(40)], batch_size=4)  # long: no second epoch is fed yet
    stats_tracker.export(local=True)
    with caplog.at_level("WARNING", logger="megarl.rollout.pool"):
        batch = engine.prepare_batch(loader, OneShotWorkflow(NEW_TOKENS, PROMPT_LEN))
    stats = stats_tracker.export(local=True)
    assert sorted(int(r) for r in batch["rewards"]) == [1, 2, 3, 4]
    _assert_clean(batch)
    assert stats["rollout/n_failed"] == 1 and stats["rollout/n_dropped_items"] == 1
    assert {"id": 0} not in engine.pool.pending_items()
    assert "failed on the servers 1 times; its item is dropped" in caplog.text


def test_too_many_failures_in_a_row_end_the_run(engine_on):
    """A server that refuses every request is not a transient fault: after max_failed_episodes failures
    in a row, wait() raises naming the limit and the server's reply."""
    engine, address = engine_on(batch_size=2, max_concurrent_rollouts=1, episode_retries=1, max_failed_episodes=3)
    _inject(address, ["400"] * 50)
    workflow = OneShotWorkflow(NEW_TOKENS, PROMPT_LEN)
    for i in range(2):
        engine.submit({"id": i}, workflow)
    with pytest.raises(RolloutError, match=r"4 episodes in a row failed .*max_failed_episodes=3.*HTTP 400"):
        engine.wait(2, timeout=60)


def test_a_success_resets_the_count(engine_on):
    """Failures that are not in a row never reach the limit."""
    engine, address = engine_on(batch_size=6, max_concurrent_rollouts=1, episode_retries=1, max_failed_episodes=1)
    _inject(address, ["400", "ok", "400", "ok", "400"])  # "ok" is not a fault: a success in between
    workflow = OneShotWorkflow(NEW_TOKENS, PROMPT_LEN)
    for i in range(3):
        engine.submit({"id": i}, workflow)
    trajs = engine.wait(3, timeout=60)
    assert sorted(int(t["rewards"][0]) for t in trajs) == [0, 1, 2]


def test_workflow_bug_still_raises(engine_on):
    """An exception of the workflow's own code is not a server failure: it reaches the trainer."""
    engine, _ = engine_on(batch_size=1)

    class Broken(OneShotWorkflow):
        async def arun_episode(self, engine, data):
            return data["missing"]

    engine.submit({"id": 0}, Broken())
    with pytest.raises(RolloutError) as info:
        engine.wait(1, timeout=30)
    assert isinstance(info.value.__cause__, KeyError)


def test_evaluation_episodes_fail_alike(engine_on):
    """rollout_batch (evaluation) episodes are run again after a server failure too."""
    engine, address = engine_on(batch_size=2, max_concurrent_rollouts=1)
    _inject(address, ["400"])
    stats_tracker.export(local=True)
    batch = engine.rollout_batch([{"id": 0}, {"id": 1}], OneShotWorkflow(NEW_TOKENS, PROMPT_LEN), is_eval=True)
    assert sorted(int(r) for r in batch["rewards"]) == [0, 1]
    _assert_clean(batch)
    assert stats_tracker.export(local=True)["eval-rollout/n_failed"] == 1


def test_random_faults_never_reach_the_trainer(fake_servers):
    """A server that fails or delays a third of its requests at random (every kind of bad reply):
    several batches, every row clean, each batch exactly its dataloader batch (synchronous RL)."""
    servers = fake_servers(2, fail_rate=0.3, delay_rate=0.2, max_delay=0.2, seed=5)
    engine = make_engine(
        [s.address for s in servers],
        batch_size=8,
        max_concurrent_rollouts=8,
        max_staleness=0,
        request_retries=3,
        episode_retries=3,
        unhealthy_retry_interval=0.2,
    )
    loader = ListLoader([{"id": i} for i in range(16)], batch_size=8)
    batches = []
    try:
        for version in range(1, 5):
            batches.append(engine.prepare_batch(loader, OneShotWorkflow(NEW_TOKENS, PROMPT_LEN)))
            engine.set_version(version)
        faults = sum(v for k, v in _stats(servers[0].address).items() if k.startswith("fault_"))
    finally:
        engine.destroy()
    assert faults > 5, "the server injected too few faults for the test to mean anything"
    for i, batch in enumerate(batches):
        _assert_clean(batch)
        first = 8 * (i % 2)
        assert sorted(int(r) for r in batch["rewards"]) == list(range(first, first + 8)), "an item lost or doubled"
