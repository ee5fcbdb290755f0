"""A server reply whose values cannot be trained on is refused, naming the reply's field and the server.

Unit level: replies shaped as vLLM 0.32's ``/v1/completions`` and SGLang 0.5's ``/generate`` send them,
parsed and checked as the client does (``check_chunk(backend.parse_generate(body), ...)``). Then the
whole path: a fake server (its own process, real HTTP) that sends a null logprob on every reply, and
the error that reaches the trainer from the rollout pool.
"""

from __future__ import annotations

import copy
import json
import urllib.request

import pytest

from megarl.rollout import RolloutError
from megarl.serving.backend import check_chunk
from megarl.serving.http import MalformedResponseError
from megarl.serving.sglang import SGLangBackend
from megarl.serving.vllm import VLLMBackend
from tests.rollout.conftest import make_engine
from tests.rollout.helpers import OneShotWorkflow

VOCAB = 49152  # SmolLM2's

VLLM_REPLY = {  # vLLM 0.32, prompt as token ids, logprobs=0, return_token_ids, return_tokens_as_token_ids
    "id": "cmpl-9f1c",
    "object": "text_completion",
    "created": 1764000000,
    "model": "/models/smollm2",
    "choices": [
        {
            "index": 0,
            "text": " 42",
            "logprobs": {
                "text_offset": [0, 1, 3],
                "token_logprobs": [-0.25, -1.5, -0.01],
                "tokens": ["token_id:216", "token_id:2220", "token_id:2"],
                "top_logprobs": [{"token_id:216": -0.25}, {"token_id:2220": -1.5}, {"token_id:2": -0.01}],
            },
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": [216, 2220, 2],
            "prompt_logprobs": None,
            "prompt_token_ids": None,
        }
    ],
    "usage": {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3, "prompt_tokens_details": None},
}

SGLANG_REPLY = {  # SGLang 0.5 /generate with input_ids and return_logprob
    "text": " 42",
    "output_ids": [216, 2220, 2],
    "meta_info": {
        "id": "5c0e",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "e2e_latency": 0.05,
        "output_token_logprobs": [[-0.25, 216, None], [-1.5, 2220, None], [-0.01, 2, None]],
    },
}


def _vllm(edit=None, without_token_ids: bool = False) -> dict:
    reply = copy.deepcopy(VLLM_REPLY)
    choice = reply["choices"][0]
    if without_token_ids:
        del choice["token_ids"]
    if edit:
        edit(choice)
    return json.loads(json.dumps(reply))  # as the client reads it (NaN and Infinity are JSON to Python)


def _sglang(edit=None) -> dict:
    reply = copy.deepcopy(SGLANG_REPLY)
    if edit:
        edit(reply)
    return json.loads(json.dumps(reply))


def _check(backend, body, vocab_size: int | None = VOCAB):
    return check_chunk(backend.parse_generate(body), max_tokens=16, vocab_size=vocab_size)


def test_clean_replies_pass_with_float_logprobs():
    for backend, body in ((VLLMBackend(), _vllm()), (VLLMBackend(), _vllm(without_token_ids=True))):
        chunk = _check(backend, body)
        assert chunk.output_tokens == [216, 2220, 2] and chunk.output_logprobs == [-0.25, -1.5, -0.01]
    chunk = _check(SGLangBackend(), _sglang())
    assert chunk.output_tokens == [216, 2220, 2] and chunk.output_logprobs == [-0.25, -1.5, -0.01]
    assert chunk.finish_reason == "stop"
    zero = _check(VLLMBackend(), _vllm(lambda c: c["logprobs"]["token_logprobs"].__setitem__(0, 0)))
    assert zero.output_logprobs[0] == 0.0 and isinstance(zero.output_logprobs[0], float), "a certain token: logprob 0"


def _set_vllm_logprob(value):
    return lambda choice: choice["logprobs"]["token_logprobs"].__setitem__(1, value)


def _set_vllm_token(value):
    def edit(choice):
        if "token_ids" in choice:
            choice["token_ids"][2] = value
        choice["logprobs"]["tokens"][2] = f"token_id:{value}"

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set_vllm_logprob(None), "choices[0].logprobs.token_logprobs[1] is null"),
        (_set_vllm_logprob(float("nan")), "choices[0].logprobs.token_logprobs[1]: logprob nan is not"),
        (_set_vllm_logprob(float("-inf")), "choices[0].logprobs.token_logprobs[1]: logprob -inf is not"),
        (_set_vllm_logprob("-0.5"), "choices[0].logprobs.token_logprobs[1] is '-0.5', not a number"),
        (_set_vllm_token(VOCAB), "choices[0].token_ids[2]: token id 49152 is outside the trainer's vocabulary"),
        (_set_vllm_token(-1), "choices[0].token_ids[2]: negative token id -1"),
        (_set_vllm_token(3.0), "choices[0].token_ids[2] is 3.0, not a token id"),
    ],
)
def test_vllm_reply_with_a_bad_value_is_refused_naming_its_field(edit, message):
    with pytest.raises(MalformedResponseError) as info:
        _check(VLLMBackend(), _vllm(edit))
    assert message in str(info.value)


def test_vllm_token_beyond_the_vocabulary_in_the_token_strings():
    """Without ``token_ids`` (older vLLM) the ids come from ``logprobs.tokens``: that field is named."""
    body = _vllm(_set_vllm_token(60000), without_token_ids=True)
    with pytest.raises(MalformedResponseError, match=r"choices\[0\]\.logprobs\.tokens\[2\]: token id 60000"):
        _check(VLLMBackend(), body)
    assert _check(VLLMBackend(), body, vocab_size=None).output_tokens[2] == 60000, (
        "no vocabulary given: any vocabulary's"
    )


@pytest.mark.parametrize("token", [2**31, 2**63 + 5])
def test_without_a_vocabulary_an_id_beyond_any_vocabulary_is_still_refused(token):
    """The engine used through AReaL's API without the trainer's vocabulary size: an id a trajectory's int32
    ids cannot hold is no token of any model."""
    with pytest.raises(MalformedResponseError, match=rf"choices\[0\]\.token_ids\[2\]: token id {token} is beyond any"):
        _check(VLLMBackend(), _vllm(_set_vllm_token(token)), vocab_size=None)
    assert _check(VLLMBackend(), _vllm(_set_vllm_token(2**31 - 1)), vocab_size=None).output_tokens[2] == 2**31 - 1


def _set_sglang(index: int, value):
    def edit(reply):
        reply["meta_info"]["output_token_logprobs"][1][index] = value
        if index == 1:
            reply["output_ids"][1] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set_sglang(0, None), "meta_info.output_token_logprobs[1][0] is null"),
        (_set_sglang(0, float("inf")), "meta_info.output_token_logprobs[1][0]: logprob inf is not"),
        (_set_sglang(1, 50000), "meta_info.output_token_logprobs[1][1]: token id 50000 is outside the trainer's"),
        (_set_sglang(1, None), "meta_info.output_token_logprobs[1][1] is None, not a token id"),
    ],
)
def test_sglang_reply_with_a_bad_value_is_refused_naming_its_field(edit, message):
    with pytest.raises(MalformedResponseError) as info:
        _check(SGLangBackend(), _sglang(edit))
    assert message in str(info.value)


def test_a_server_sending_null_logprobs_fails_the_run_naming_server_and_field(fake_servers):
    """The fake server nulls the last logprob of every reply: each request is retried, then fails naming the
    server, the endpoint and the field; after ``max_failed_episodes`` such episodes in a row the rollout pool
    raises that to the trainer. Nothing is trained on: no trajectory comes back."""
    (server,) = fake_servers(1)
    engine = make_engine([server.address], batch_size=1, request_retries=1, episode_retries=0, max_failed_episodes=1)
    body = json.dumps({"faults": ["null_logprob"] * 20}).encode()
    urllib.request.urlopen(urllib.request.Request(f"http://{server.address}/_faults", data=body, method="POST"))
    try:
        engine.submit({"id": 0}, OneShotWorkflow(max_new_tokens=6, prompt_len=5))
        engine.submit({"id": 1}, OneShotWorkflow(max_new_tokens=6, prompt_len=5))
        with pytest.raises(RolloutError) as info:
            engine.wait(1, timeout=60)
    finally:
        engine.destroy()
    text = str(info.value)
    assert "2 episodes in a row failed on the inference servers (rollout.max_failed_episodes=1)" in text, text
    assert f"inference server {server.address}/v1/completions failed after 2 attempts" in text, text
    assert "malformed reply (choices[0].logprobs.token_logprobs[5] is null" in text, text


def test_a_control_error_crosses_a_process_boundary():
    """A trainer head's process raises it and another process reads it (the scale simulation's heads, a
    process pool's result): it unpickles with its address, route and reason, not a TypeError."""
    import pickle

    from megarl.serving.http import ServerControlError

    error = pickle.loads(pickle.dumps(ServerControlError("10.0.0.1:8000", "/v1/completions", "no logprobs")))
    assert (error.address, error.route, error.reason) == ("10.0.0.1:8000", "/v1/completions", "no logprobs")
    assert str(error) == "inference server 10.0.0.1:8000/v1/completions: no logprobs"
