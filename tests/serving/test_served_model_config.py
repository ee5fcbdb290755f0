"""What a served model's own files do to megarl's requests, on a real vLLM-CPU server launched as megarl
launches it: a tiny Mistral whose ``sliding_window`` is 4 tokens and whose ``generation_config.json`` asks
for ``repetition_penalty: 5.0`` (Qwen2.5-Instruct's asks for 1.05).

* The window: the server scores tokens as HF does with it. The trainer's side is checked against the same
  HF model in ``tests/actor/test_parity.py`` (over TP and shared prefixes), so trainer and server agree
  through HF. Both sides compute in fp32: a logprob differs only by summation order, ~1e-6 for a model this
  small; the tolerance is 1e-4, and dropping the window moves the logprobs by tenths.
* The penalty: vLLM fills each sampling field a request leaves out from ``generation_config.json``;
  megarl's requests name them all, so they sample from the model's own distribution.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megarl.api.io_struct import GenerationHyperparameters
from megarl.serving import VLLMBackend
from megarl.serving.backend import NO_PENALTIES
from tests.conftest import serve_vllm
from tests.rollout.test_vllm_integration import complete, rescore

pytestmark = pytest.mark.vllm

TOL = 1e-4


@pytest.fixture(scope="module")
def mistral_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Mistral (sliding_window 4) with a generation_config.json asking for a repetition penalty."""
    model = tmp_path_factory.mktemp("served") / "mistral"
    shutil.copytree(tiny_model_dir("mistral"), model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "repetition_penalty": 5.0}))
    return model


@pytest.fixture(scope="module")
def server(mistral_dir, tmp_path_factory):
    with serve_vllm(mistral_dir, tmp_path_factory.mktemp("vllm_mistral"), dtype="float32") as served:
        yield served


def _hf_logprobs(model_dir, ids: list[int], **config) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **config).eval()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_the_server_attends_through_the_models_window(mistral_dir, server):
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    served = rescore(server.address, ids)[1:]
    windowed = _hf_logprobs(mistral_dir, ids)
    whole = _hf_logprobs(mistral_dir, ids, sliding_window=None)
    assert max(abs(a - b) for a, b in zip(served, windowed)) <= TOL
    assert max(abs(a - b) for a, b in zip(served, whole)) > 100 * TOL  # the window binds on 20 tokens


def _greedy_tokens(address: str, payload: dict) -> list[int]:
    return complete(address, payload)["token_ids"]


def test_requests_sample_without_the_models_generation_config_defaults(server):
    """A random model's greedy answer repeats tokens, which the model's penalty would forbid: megarl's
    request gets what the same request with the neutral values spelled out gets, and one that leaves the
    penalty fields out gets something else (so the server does apply the file's defaults)."""
    gconfig = GenerationHyperparameters(max_new_tokens=16, greedy=True)
    payload = VLLMBackend().generate_payload(list(range(1, 9)), gconfig, 16, 16)
    neutral = _greedy_tokens(server.address, {**payload, "repetition_penalty": 1.0})
    assert len(set(neutral)) < len(neutral)  # the unpenalised answer repeats itself
    assert _greedy_tokens(server.address, payload) == neutral
    omitted = {key: value for key, value in payload.items() if key not in NO_PENALTIES}
    assert _greedy_tokens(server.address, omitted) != neutral
