"""A server that dies and is restarted by the launcher: no sample half from it, its episodes run again
from scratch (the item's retries untouched), and the restarted server takes no request until the
trainer has pushed its weights (``mark_healthy``). Servers that join the run (``megarl serve --join``)
wait for the push the same way."""

from __future__ import annotations

import asyncio
import json
import time

from megarl.api import ModelRequest
from megarl.api.io_struct import GenerationHyperparameters
from megarl.rollout import RemoteInferenceEngine
from megarl.serving.restarts import JOINS_FILE, RESTARTS_FILE, append_record
from megarl.utils import stats_tracker
from tests.rollout.conftest import fast_config, make_engine
from tests.rollout.helpers import OneShotWorkflow, expected_tokens


def _record_restart(run_dir, address: str) -> None:
    with open(run_dir / RESTARTS_FILE, "a") as f:
        f.write(json.dumps({"server": "server-0", "address": address, "restart": 1}) + "\n")


def test_a_sample_half_generated_on_a_dead_server_reruns_its_episode_from_scratch(fake_servers):
    """Interrupted samples (a pause) whose server dies meanwhile are not continued elsewhere: their
    episodes run again from scratch, even with ``episode_retries=0``; no item is dropped."""
    servers = fake_servers(2, token_delay=0.02)
    engine = make_engine(
        [s.address for s in servers],
        batch_size=8,
        max_concurrent_rollouts=8,
        max_staleness=4,
        episode_retries=0,
        request_retries=1,
    )
    stats_tracker.export(local=True)
    try:
        for i in range(8):
            engine.submit({"id": i}, OneShotWorkflow(max_new_tokens=60, prompt_len=5))
        time.sleep(0.5)  # every sample has tokens on both servers
        engine.pause()
        time.sleep(0.5)  # the aborted chunks (their tokens) are back
        servers[0].proc.kill()
        servers[0].proc.wait()
        engine.resume()
        trajs = engine.wait(8, timeout=60)
        stats = stats_tracker.export(local=True)
    finally:
        engine.destroy()
    assert sorted(int(t["rewards"][0]) for t in trajs) == list(range(8)), "an item lost or doubled"
    tokens, _ = expected_tokens(5, 60)
    assert all(t["input_ids"][0, 5:].tolist() == tokens for t in trajs)
    assert stats["rollout/failed/server_lost"] >= 1
    assert stats.get("rollout/n_dropped_items", 0) == 0


def test_a_restarted_server_waits_for_the_trainers_weights(fake_servers, tmp_path):
    a, b = fake_servers(2)
    engine = RemoteInferenceEngine(fast_config(unhealthy_retry_interval=0.01), "vllm")
    engine.initialize(server_addrs=[a.address, b.address], batch_size=2, dump_dir=str(tmp_path))
    engine.servers._restarts.poll_s = 0.0
    try:
        _record_restart(tmp_path, a.address)
        assert {engine.servers.choose().address for _ in range(8)} == {b.address}
        time.sleep(0.05)  # past the retry interval of transient failures: still out
        assert {engine.servers.choose().address for _ in range(8)} == {b.address}
        assert engine.restarts_seen == 1
        assert engine.servers.to_readmit() == ([a.address], [])
        assert not engine.readmit_due(), "b still generates: the push waits for the next weight update"
        engine.servers.mark_healthy(a.address)  # the trainer pushed its weights
        assert engine.servers.to_readmit() == ([], [])
        assert a.address in {engine.servers.choose(f"r{i}").address for i in range(8)}
    finally:
        engine.destroy()


def test_with_every_server_restarted_requests_wait_for_the_push(fake_servers, tmp_path):
    """The only server restarted: a request waits (it does not fail its episode) and the pool asks for
    a push (``readmit_due``); once pushed, the request is served."""
    (a,) = fake_servers(1)
    engine = RemoteInferenceEngine(fast_config(), "vllm")
    engine.initialize(server_addrs=[a.address], batch_size=2, dump_dir=str(tmp_path))
    engine.servers._restarts.poll_s = 0.0
    _record_restart(tmp_path, a.address)

    try:
        due, resp = asyncio.run(_generate_across_a_push(engine, a.address))
    finally:
        engine.destroy()
    assert due
    assert resp.output_tokens == expected_tokens(3, 6)[0]


async def _generate_across_a_push(engine, address: str, before_push=lambda: None):
    """A request made while no server is in rotation: it must still wait 0.5 s later; then ``before_push()``,
    the pool's ask for a push (``readmit_due``) and the push (``mark_healthy``). ``(due, the response)``."""
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=6)
    request = asyncio.ensure_future(engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=gconfig)))
    await asyncio.sleep(0.5)
    assert not request.done(), "the request waits for the push instead of failing"
    before_push()
    due = await asyncio.to_thread(engine.readmit_due)
    engine.servers.mark_healthy(address)  # the trainer pushed its weights
    return due, await asyncio.wait_for(request, 10)


def test_a_server_whose_update_found_it_dead_is_waited_for_until_its_restart_is_recorded(fake_servers, tmp_path):
    """The only server died just before a weight update, which failed on it and took it out of rotation,
    and the launcher records its restart only after stopping what it left (seconds later): requests wait
    for the restart and the push instead of failing their episodes at once (every one of them within
    milliseconds, which ended a run at ``rollout.max_failed_episodes``)."""
    (a,) = fake_servers(1)
    engine = RemoteInferenceEngine(fast_config(), "vllm")
    engine.initialize(server_addrs=[a.address], batch_size=2, dump_dir=str(tmp_path))
    engine.servers._restarts.poll_s = 0.0
    engine.servers.record_update([], {a.address: "ServerControlError: connection failed: ConnectionRefusedError"})

    try:  # the restart is recorded while the request waits
        due, resp = asyncio.run(
            _generate_across_a_push(engine, a.address, lambda: _record_restart(tmp_path, a.address))
        )
    finally:
        engine.destroy()
    assert due
    assert resp.output_tokens == expected_tokens(3, 6)[0]


def test_under_a_launcher_a_server_death_reruns_every_episode_it_had(fake_servers, tmp_path):
    """With the run directory (a launcher that restarts servers), a request on a server that dies fails its
    episode even with no token yet: the episode's samples that finished before the death are not kept."""
    servers = fake_servers(2, token_delay=0.02)
    engine = RemoteInferenceEngine(
        fast_config(episode_retries=0, request_retries=1, max_concurrent_rollouts=8, max_staleness=4), "vllm"
    )
    engine.initialize(server_addrs=[s.address for s in servers], batch_size=8, dump_dir=str(tmp_path))
    stats_tracker.export(local=True)
    try:
        for i in range(8):
            engine.submit({"id": i}, OneShotWorkflow(max_new_tokens=60, prompt_len=5))
        time.sleep(0.3)  # in flight on both servers, no chunk back yet
        servers[0].proc.kill()
        trajs = engine.wait(8, timeout=60)
        stats = stats_tracker.export(local=True)
    finally:
        engine.destroy()
    assert sorted(int(t["rewards"][0]) for t in trajs) == list(range(8))
    assert stats["rollout/failed/server_lost"] >= 1 and stats.get("rollout/n_dropped_items", 0) == 0


def _record_join(run_dir, address: str, event: str = "join") -> None:
    append_record(run_dir / JOINS_FILE, {"event": event, "server": "server-9", "address": address})


def test_a_joined_server_serves_after_the_push_and_a_leaving_one_is_drained(fake_servers, tmp_path):
    """Elastic servers: a joined server is in the pool but takes no request until the trainer has pushed
    its weights; one that leaves takes no new request, is reported down (the bridge lets it go) and is
    never readmitted."""
    a, b = fake_servers(2)
    engine = RemoteInferenceEngine(fast_config(), "vllm")
    engine.initialize(server_addrs=[a.address], batch_size=2, dump_dir=str(tmp_path))
    engine.servers._joins.poll_s = 0.0
    try:
        (tmp_path / JOINS_FILE).write_text("not json\n")  # a malformed line is skipped with a warning
        _record_join(tmp_path, b.address)
        assert {engine.servers.choose(f"r{i}").address for i in range(8)} == {a.address}
        assert engine.server_addresses == [a.address, b.address] and engine.servers_joined == 1
        assert engine.servers.to_readmit() == ([b.address], [])
        engine.servers.mark_healthy(b.address)  # the weight sync reached it
        usable = lambda: [s.address for s in engine.servers._servers if s.usable(time.monotonic())]  # noqa: E731
        assert usable() == [a.address, b.address]
        _record_join(tmp_path, b.address, "leave")
        assert {engine.servers.choose(f"t{i}").address for i in range(8)} == {a.address} and usable() == [a.address]
        assert engine.servers.to_readmit() == ([], [b.address])
        engine.servers.mark_healthy(b.address)  # a later update does not bring it back
        assert usable() == [a.address]
    finally:
        engine.destroy()
