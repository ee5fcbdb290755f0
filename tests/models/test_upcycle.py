"""Upcycling a dense Llama into a Mixtral-layout MoE (``megarl.models.upcycle``), and the Mixtral family that
loads it: the HF model of the upcycled directory against the dense one, Megatron's against HF's."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.models.upcycle import UpcycleRecipe, check_upcycled, upcycle
from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_batch


def _hf_logp(model_dir, batch: dict) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids, attn = batch["input_ids"].long(), batch["attention_mask"]
    with torch.no_grad():
        logits = model(ids, attention_mask=attn).logits.double()
    out = torch.zeros(ids.shape, dtype=torch.float64)
    out[:, :-1] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * attn[:, 1:]
    return out


@pytest.fixture(scope="module")
def dense(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def batch():
    return make_batch([7, 12, 5], seed=2)


def test_without_noise_the_moe_is_the_dense_model(dense, batch, tmp_path):
    """Identical experts whose renormalised weights sum to 1: any routing gives the dense MLP's output."""
    moe = upcycle(dense, tmp_path / "moe", UpcycleRecipe(num_experts=4, top_k=2, noise=0.0))
    config = json.loads((moe / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2
    assert config["upcycled_from"]["recipe"]["noise"] == 0.0
    diff = (_hf_logp(moe, batch) - _hf_logp(dense, batch)).abs().max()
    assert diff <= 1e-5  # fp32: the expert sum reorders a few additions


def test_noise_moves_the_logprobs_and_the_check_refuses_too_much(dense, tmp_path):
    recipe = UpcycleRecipe(noise=0.001, seed=3)
    small = check_upcycled(dense, upcycle(dense, tmp_path / "small", recipe), recipe)
    assert 0 < small <= recipe.max_logprob_diff
    loud = UpcycleRecipe(noise=1.0, max_logprob_diff=0.05)
    with pytest.raises(RuntimeError, match="lower the recipe's noise"):
        check_upcycled(dense, upcycle(dense, tmp_path / "loud", loud), loud)


def test_only_a_dense_llama_is_upcycled(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="expected a dense llama"):
        upcycle(tiny_model_dir("qwen3_moe"), tmp_path / "x")
    with pytest.raises(ValueError, match="top_k=5"):
        UpcycleRecipe(num_experts=4, top_k=5)


@pytest.mark.multiproc
@pytest.mark.parametrize("alloc, world", [("d1p1t1", 1), ("d2p1t1e2", 2)])
def test_megatron_loads_the_upcycled_mixtral_as_hf_does(dense, batch, tmp_path_factory, alloc, world):
    """The Mixtral family (``block_sparse_moe``, experts ``w1`` / ``w3`` / ``w2``) on one rank and over EP2."""
    moe = upcycle(dense, tmp_path_factory.mktemp("mixtral") / "moe", UpcycleRecipe(noise=0.05, router_std=0.5))
    results = run_ranks(world, "tests.actor.workers:logprobs", model_dir=str(moe), alloc=alloc, batch=batch)
    mask = torch.zeros_like(batch["attention_mask"], dtype=torch.bool)
    mask[:, :-1] = batch["attention_mask"][:, 1:].bool()
    for got in results:
        assert (got.double() - _hf_logp(moe, batch)).abs()[mask].max() <= 1e-4  # fp32, as tests/actor/test_parity.py


@pytest.mark.slow  # converts the GGUF base once if the cache lacks it, then writes 1.5 GB
def test_smollm2_moe_is_provisioned_from_the_dense_model(tmp_path):
    from megarl.models.provision import SOURCE_FILE, resolve_model_path

    moe = resolve_model_path("smollm2-135m-moe", cache_dir=tmp_path)
    source = json.loads((tmp_path / "smollm2-135m-moe" / SOURCE_FILE).read_text())
    assert source["upcycled_from"] == "smollm2-135m-instruct" and source["recipe"]["num_experts"] == 4
    assert json.loads((tmp_path / "smollm2-135m-moe" / "config.json").read_text())["model_type"] == "mixtral"
    assert moe == str(tmp_path / "smollm2-135m-moe")
