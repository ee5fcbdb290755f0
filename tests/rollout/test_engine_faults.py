"""RemoteInferenceEngine against fault-injecting fake servers: continuation, retries, failover."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from megarl.api import ModelRequest
from megarl.api.io_struct import GenerationHyperparameters, derive_seed
from megarl.rollout import RemoteInferenceEngine
from megarl.serving import InferenceServerError
from tests.rollout.conftest import fast_config, make_engine
from tests.rollout.fake_server import CORRUPTIONS, TRANSPORT_FAULTS
from tests.rollout.helpers import OneShotWorkflow, expected_tokens

PROMPT = [101, 102, 103, 104, 105]
SEED = 11


def _post(addr: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://{addr}{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _stats(addr: str) -> dict:
    with urllib.request.urlopen(f"http://{addr}/_stats", timeout=10) as resp:
        return json.loads(resp.read())


def _generate(engine: RemoteInferenceEngine, max_new_tokens: int = 12, rid: str | None = None, seed: int | None = None):
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=max_new_tokens, seed=seed)
    req = ModelRequest(input_ids=PROMPT, gconfig=gconfig) if rid is None else ModelRequest(rid, PROMPT, gconfig)
    return asyncio.run(engine.agenerate(req))


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_agenerate_token_aligned(fake_servers, dialect):
    (server,) = fake_servers(1, dialect=dialect, eos_every=0)
    engine = RemoteInferenceEngine(fast_config(), dialect)
    engine.initialize(server_addrs=[server.address], batch_size=2)
    try:
        engine.set_version(3)
        resp = _generate(engine, 12)
    finally:
        engine.destroy()
    tokens, logprobs = expected_tokens(len(PROMPT), 12)
    assert resp.output_tokens == tokens
    assert resp.output_logprobs == pytest.approx(logprobs)
    assert resp.output_versions == [3] * 12
    assert resp.stop_reason == "length" and resp.input_tokens == PROMPT
    assert resp.latency > 0 and resp.ttft > 0


def test_stop_reason_stop(fake_servers):
    (server,) = fake_servers(1, eos_every=9)  # EOS at absolute position 9: 4 tokens after the 5-token prompt
    engine = make_engine([server.address])
    try:
        resp = _generate(engine, 50)
    finally:
        engine.destroy()
    assert resp.stop_reason == "stop" and resp.output_len == 5 and resp.output_tokens[-1] == 2


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_pause_aborts_and_resume_continues(fake_servers, dialect):
    (server,) = fake_servers(1, dialect=dialect, token_delay=0.01)
    engine = RemoteInferenceEngine(fast_config(), dialect).initialize(server_addrs=[server.address], batch_size=2)
    result = {}

    def generate():
        result["resp"] = _generate(engine, 60, seed=SEED)  # ~0.6 s uninterrupted

    try:
        thread = threading.Thread(target=generate)
        thread.start()
        deadline = time.monotonic() + 30
        while not _stats(server.address).get("generate") and time.monotonic() < deadline:
            time.sleep(0.02)  # the request reached the server (a loaded machine may take longer than 0.25 s)
        time.sleep(0.25)  # ~25 tokens generated before the pause
        engine.pause()
        assert _stats(server.address)["paused"]
        time.sleep(0.3)  # the "weight update"
        engine.set_version(1)
        engine.resume()
        thread.join(30)
    finally:
        engine.destroy()
    resp = result["resp"]
    tokens, logprobs = expected_tokens(len(PROMPT), 60)
    assert resp.output_tokens == tokens, "interrupted generation lost or duplicated tokens"
    assert resp.output_logprobs == pytest.approx(logprobs)
    assert resp.n_interruptions >= 1
    first_new = resp.output_versions.index(1)
    assert 0 < first_new < 60
    assert resp.output_versions == [0] * first_new + [1] * (60 - first_new)
    stats = _stats(server.address)
    assert stats["pause"] == 1 and stats["resume"] == 1
    if dialect == "sglang":
        assert stats["flush_cache"] == 1
    for payload in stats["payloads"]:  # the first request, then its continuations
        seed = payload["seed"] if dialect == "vllm" else payload["sampling_params"]["sampling_seed"]
        done = (payload["prompt"] if dialect == "vllm" else payload["input_ids"])[len(PROMPT) :]
        assert seed == (derive_seed(SEED, done, len(done)) if done else SEED), "continuations draw fresh seeds"


def test_paused_requests_wait_without_polling(fake_servers, monkeypatch):
    """Requests held by a pause cost nothing until the resume: at 2,048 episodes a 20 Hz poll each
    was most of the rollout loop's CPU during a weight update (the 256-server simulation)."""
    (server,) = fake_servers(1)
    engine = make_engine([server.address])
    sleeps = []
    real_sleep = asyncio.sleep

    async def counting_sleep(delay, *args, **kwargs):
        sleeps.append(delay)
        return await real_sleep(delay, *args, **kwargs)

    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=4)
    try:
        engine.pause()
        monkeypatch.setattr(asyncio, "sleep", counting_sleep)
        futures = [
            asyncio.run_coroutine_threadsafe(engine.agenerate(request), engine.pool.loop)
            for request in [ModelRequest(input_ids=PROMPT, gconfig=gconfig) for _ in range(200)]
        ]
        time.sleep(0.5)
        assert not any(f.done() for f in futures), "a request went out while paused"
        assert sleeps == [], f"paused requests polled {len(sleeps)} times in 0.5 s"
        monkeypatch.undo()
        engine.resume()
        responses = [f.result(timeout=30) for f in futures]
    finally:
        engine.destroy()
    tokens, _ = expected_tokens(len(PROMPT), 4)
    assert all(r.output_tokens == tokens for r in responses)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_colocated_sleep_holds_generation_until_wake_and_resume(fake_servers, dialect):
    """Colocated placement: ``sleep`` aborts the in-flight request and frees the server; nothing is generated
    while it sleeps, nor after ``wake`` alone (vLLM's wake resumes its scheduler, the engine holds the request);
    after the weight update's resume the request continues with no token lost or repeated."""
    (server,) = fake_servers(1, dialect=dialect, token_delay=0.01)
    engine = RemoteInferenceEngine(fast_config(), dialect).initialize(server_addrs=[server.address], batch_size=2)
    result = {}
    thread = threading.Thread(target=lambda: result.update(resp=_generate(engine, 60, seed=SEED)))
    try:
        thread.start()
        time.sleep(0.25)
        engine.sleep()
        asleep = _stats(server.address)
        assert asleep["sleeping"] and asleep["generate"] == 1
        time.sleep(0.3)  # the trainer computes
        engine.wake()
        time.sleep(0.2)
        awake = _stats(server.address)
        assert not awake["sleeping"] and awake["generate"] == 1, "woken: the request waits for the weight update"
        engine.pause()  # update_weights: pause, push, version, resume
        engine.set_version(1)
        engine.resume()
        thread.join(30)
    finally:
        engine.destroy()
    resp = result["resp"]
    assert resp.output_tokens == expected_tokens(len(PROMPT), 60)[0], "interrupted generation lost or duplicated tokens"
    first_new = resp.output_versions.index(1)
    assert resp.n_interruptions >= 1 and resp.output_versions == [0] * first_new + [1] * (60 - first_new)
    stats = _stats(server.address)
    assert stats["sleep"] == 1 and stats["wake"] == 1 and stats.get("tokens_while_sleeping", 0) == 0


def test_corrupted_replies_are_retried_and_never_returned(fake_servers):
    """Complete 200 replies that cannot be trained on (NaN or positive logprobs, more tokens than asked,
    a negative id, lists of different lengths, ...) are retried; what comes back is the clean sample."""
    (server,) = fake_servers(1)
    engine = make_engine([server.address], request_retries=len(CORRUPTIONS), retry_backoff=0.001)  # 2**n backoff
    try:
        _post(server.address, "/_faults", {"faults": list(CORRUPTIONS)})
        resp = _generate(engine, 8)
    finally:
        engine.destroy()
    tokens, logprobs = expected_tokens(len(PROMPT), 8)
    assert resp.output_tokens == tokens and resp.output_logprobs == pytest.approx(logprobs)
    stats = _stats(server.address)
    assert stats["generate"] == len(CORRUPTIONS) + 1 and all(stats[f"fault_{c}"] == 1 for c in CORRUPTIONS)


@pytest.mark.parametrize("fault", sorted(TRANSPORT_FAULTS))
def test_transport_faults_retried_or_refused(fake_servers, fault):
    """Every kind of bad reply (status, body, a trickle, a connection dropped before or in the middle
    of the body): retried, and the sample is the clean one; a 4xx that retrying cannot fix (400, 404)
    fails at once with ``kind='http_4xx'``, after one attempt; a hang uses the request's whole deadline
    (``request_timeout``) and fails with ``kind='timeout'``, after one attempt."""
    (server,) = fake_servers(1)
    engine = make_engine([server.address], request_retries=2, request_timeout=1.0)
    try:
        _post(server.address, "/_faults", {"faults": [fault]})
        if fault == "hang":
            with pytest.raises(InferenceServerError) as info:
                _generate(engine, 8)
            assert info.value.kind == "timeout" and info.value.attempts == 1
        elif TRANSPORT_FAULTS[fault] == "fail":
            with pytest.raises(InferenceServerError) as info:
                _generate(engine, 8)
            assert info.value.kind == "http_4xx" and info.value.attempts == 1
            assert f"HTTP {fault} (bad request, not retried)" in str(info.value)
        else:
            resp = _generate(engine, 8)
            tokens, logprobs = expected_tokens(len(PROMPT), 8)
            assert resp.output_tokens == tokens and resp.output_logprobs == pytest.approx(logprobs)
    finally:
        engine.destroy()
    stats = _stats(server.address)
    assert stats[f"fault_{fault}"] == 1
    assert stats["generate"] == (1 if TRANSPORT_FAULTS[fault] == "fail" or fault == "hang" else 2)


def test_retries_then_succeeds(fake_servers):
    (server,) = fake_servers(1)
    engine = make_engine([server.address], request_retries=3)
    try:
        _post(server.address, "/_faults", {"faults": ["500", "malformed", "bad_shape"]})
        resp = _generate(engine, 8)
    finally:
        engine.destroy()
    assert resp.output_tokens == expected_tokens(len(PROMPT), 8)[0]
    assert _stats(server.address)["generate"] == 4


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("500", "HTTP 500"),
        ("malformed", "malformed reply"),
        ("bad_shape", "malformed reply"),
        ("hang", "no complete reply"),
        ("trickle", "no complete reply"),
        ("429", "HTTP 429"),
        ("503", "HTTP 503"),
        ("html", "malformed reply"),
        ("empty_body", "malformed reply"),
        ("nan_logprob", "choices[0].logprobs.token_logprobs[0]: logprob nan is not a log-probability"),
        ("positive_logprob", "choices[0].logprobs.token_logprobs[0]: logprob 0.5 is not a log-probability"),
        ("extra_tokens", "9 tokens for a request of at most 8"),
        ("negative_token", "choices[0].token_ids[0]: negative token id -5"),
        ("length_mismatch", "8 token ids but 7 logprobs"),
        ("null_logprob", "choices[0].logprobs.token_logprobs[7] is null"),
        ("vocab_token", "choices[0].token_ids[0]: token id 1024 is outside the trainer's vocabulary of 1024"),
        ("string_token", "choices[0].token_ids[0] is 'seven', not a token id"),
    ],
)
def test_retry_budget_spent_raises_clear_error(fake_servers, fault, message):
    (server,) = fake_servers(1)
    engine = make_engine([server.address], request_retries=2, request_timeout=0.5)
    try:
        _post(server.address, "/_faults", {"faults": [fault] * 3})
        with pytest.raises(InferenceServerError) as info:
            _generate(engine, 8)
    finally:
        engine.destroy()
    err = info.value
    attempts = "after 1 attempt" if fault == "hang" else "after 3 attempts"  # a hang spends the whole deadline
    assert message in str(err) and server.address in str(err) and attempts in str(err)
    assert err.endpoint == "/v1/completions"


def test_disconnect_is_retried_on_the_same_server(fake_servers):
    (server,) = fake_servers(1)
    engine = make_engine([server.address])
    try:
        _post(server.address, "/_faults", {"faults": ["disconnect"]})
        resp = _generate(engine, 6)
    finally:
        engine.destroy()
    assert resp.output_tokens == expected_tokens(len(PROMPT), 6)[0]


def test_sticky_and_least_loaded_routing(fake_servers):
    servers = fake_servers(2)
    engine = make_engine([s.address for s in servers])

    async def many():
        gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=20)
        same = [engine.agenerate(ModelRequest("rid-a", PROMPT, gconfig)) for _ in range(4)]
        spread = [engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=gconfig)) for _ in range(8)]
        return await asyncio.gather(*same), await asyncio.gather(*spread)

    try:
        same, spread = asyncio.run(many())
    finally:
        engine.destroy()
    assert len({r.server for r in same}) == 1, "requests sharing a rid must stick to one server"
    counts = [sum(r.server == s.address for r in spread) for s in servers]
    assert counts == [4, 4], f"least-loaded routing should balance, got {counts}"


def test_server_killed_mid_flight_requests_reissued(fake_servers):
    servers = fake_servers(2, token_delay=0.01)
    engine = make_engine([s.address for s in servers], batch_size=16, max_concurrent_rollouts=16, max_staleness=4)
    workflow = OneShotWorkflow(max_new_tokens=40, prompt_len=5)
    try:
        for i in range(16):
            engine.submit({"id": i}, workflow)
        time.sleep(0.3)  # requests are in flight on both servers
        os.kill(servers[0].pid, signal.SIGKILL)  # the server itself dies, not its keeper
        trajs = engine.wait(16, timeout=60)
    finally:
        engine.destroy()
    ids = sorted(int(t["rewards"][0]) for t in trajs)
    assert ids == list(range(16)), "a trajectory was lost or duplicated"
    tokens, logprobs = expected_tokens(5, 40)
    for traj in trajs:
        assert traj["input_ids"][0, 5:].tolist() == tokens
        assert traj["logprobs"][0, 5:].tolist() == pytest.approx(logprobs)
    assert not engine.servers._servers[0].usable(time.monotonic())


def test_all_servers_dead_surfaces_error(fake_servers):
    """Every server down: the request waits out each server's unhealthy interval ``request_retries``
    times, then fails naming every server and why it was taken out of rotation."""
    (server,) = fake_servers(1)
    engine = make_engine([server.address], request_retries=1, retry_backoff=0.01, unhealthy_retry_interval=0.5)
    server.stop()
    start = time.monotonic()
    try:
        with pytest.raises(InferenceServerError) as info:
            _generate(engine, 4)
    finally:
        engine.destroy()
    assert info.value.kind == "no_server" and time.monotonic() - start >= 0.5
    assert f"all 1 inference servers are marked unhealthy: [{server.address}] " in str(info.value)
    assert "connection failed" in str(info.value)


def test_a_server_back_within_its_unhealthy_interval_serves_the_waiting_request(fake_servers):
    """A lone server that drops two connections in a row is out of rotation for a moment; the request
    waits for it instead of failing its episode."""
    (server,) = fake_servers(1)
    engine = make_engine([server.address], request_retries=1, unhealthy_retry_interval=0.3)
    try:
        _post(server.address, "/_faults", {"faults": ["disconnect", "disconnect"]})
        resp = _generate(engine, 6)
    finally:
        engine.destroy()
    assert resp.output_tokens == expected_tokens(len(PROMPT), 6)[0]


def test_server_addrs_from_env(monkeypatch, fake_servers):
    (server,) = fake_servers(1)
    monkeypatch.setenv("MEGARL_LLM_SERVER_ADDRS", server.address)
    engine = RemoteInferenceEngine(fast_config()).initialize(batch_size=1)
    try:
        assert [s.address for s in engine.servers._servers] == [server.address]
    finally:
        engine.destroy()


def test_no_servers_configured_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("MEGARL_LLM_SERVER_ADDRS", raising=False)
    with pytest.raises(ValueError, match="no inference servers"):
        RemoteInferenceEngine(fast_config()).initialize(batch_size=1)


def test_mark_unhealthy_keeps_a_server_out_until_marked_healthy(fake_servers):
    """A server that failed a weight update takes no requests, however long, until it is current again."""
    a, b = fake_servers(2, eos_every=0)
    config = fast_config()
    config.unhealthy_retry_interval = 0.01
    engine = RemoteInferenceEngine(config, "vllm")
    engine.initialize(server_addrs=[a.address, b.address], batch_size=2)
    try:
        assert engine.server_addresses == [a.address, b.address]
        engine.servers.mark_unhealthy(a.address, "weight update to version 1 failed")
        time.sleep(0.05)  # past the retry interval of transient failures
        assert {engine.servers.choose().address for _ in range(8)} == {b.address}
        engine.servers.mark_healthy(a.address)
        assert a.address in {engine.servers.choose(f"r{i}").address for i in range(8)}
        with pytest.raises(ValueError, match="not one of the servers"):
            engine.servers.mark_unhealthy("127.0.0.1:1", "nope")
    finally:
        engine.destroy()


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_routed_experts_follow_their_tokens_across_an_interruption(fake_servers, dialect):
    """``rollout.return_routed_experts`` (each dialect's reply encoding): each generated token keeps the
    experts of the forward that produced it, also when a pause cut the request and the rest came from a
    second request (whose input repeats the first answer tokens); the prompt's come from the first request."""
    from tests.rollout.fake_server import routed_at

    (server,) = fake_servers(1, dialect=dialect, token_delay=0.01)
    config = fast_config(return_routed_experts=True)
    engine = RemoteInferenceEngine(config, dialect).initialize(server_addrs=[server.address], batch_size=2)
    result = {}
    try:
        thread = threading.Thread(target=lambda: result.update(resp=_generate(engine, 40, seed=SEED)))
        thread.start()
        time.sleep(0.2)
        engine.pause()
        time.sleep(0.2)
        engine.resume()
        thread.join(30)
    finally:
        engine.destroy()
    resp = result["resp"]
    assert resp.n_interruptions >= 1 and resp.output_len == 40
    n_in = len(PROMPT)
    assert resp.output_routed_experts == [routed_at(n_in - 1 + i) for i in range(40)]
    assert resp.input_routed_experts == [routed_at(p) for p in range(n_in - 1)]
    payloads = _stats(server.address)["payloads"]
    starts = {p.get("routed_experts_prompt_start", p.get("routed_experts_start_len")) for p in payloads}
    assert starts == {0}, "every forwarded position is asked for"
