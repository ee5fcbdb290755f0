"""MoE routing agreement (``megarl.actor.moe_routing``): a tiny Qwen3-MoE actor against the HF model's own
router choices standing in for the server's, on one rank and across pipeline stages."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_grouped_batch


def hf_routing(model_dir, batch: dict) -> torch.Tensor:
    """``[B, S, layers * top-k]``: the HF model's top-k experts for the forward that produced each
    completion token (token-aligned: row ``p`` holds input position ``p - 1``), -1 elsewhere."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = model.model.layers
    seen: list = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: seen.append(out[2])) for layer in layers]
    k = model.config.num_experts_per_tok
    routed = torch.full((*batch["input_ids"].shape, len(layers) * k), -1, dtype=torch.int16)
    with torch.no_grad():
        for b, length in enumerate(batch["attention_mask"].sum(-1).tolist()):
            seen.clear()
            model(batch["input_ids"][b : b + 1, :length].long())
            per_position = torch.cat(seen, dim=-1)  # [length, layers * k], layer-major
            completion = batch["loss_mask"][b, :length].nonzero().flatten()
            routed[b, completion] = per_position[completion - 1].to(torch.int16)
    for hook in hooks:
        hook.remove()
    return routed


@pytest.fixture(scope="module")
def moe_batch(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3_moe")
    batch = make_grouped_batch(4, 2, prompt_len=6, seed=5)
    batch["rewards"] = torch.tensor([1.0, 0.0] * 4)  # every group has something to learn: no row skipped
    batch["routed_experts"] = hf_routing(model_dir, batch)
    return model_dir, batch


@pytest.mark.multiproc
# About a minute each: CI runs the EP x DP case, the slow tests the others.
@pytest.mark.parametrize(
    "alloc, world",
    [
        pytest.param("d1p1t1", 1, marks=pytest.mark.slow),
        pytest.param("d1p2t1", 2, marks=pytest.mark.slow),
        pytest.param("d1p1t2", 2, marks=pytest.mark.slow),
        ("d2p1t1e2", 2),
    ],
)
def test_routing_agreement_with_the_reference(moe_batch, alloc, world):
    model_dir, batch = moe_batch
    n_layers = batch["routed_experts"].shape[-1] // 2  # top-2 of 4 experts in every layer
    n_pairs = int(batch["loss_mask"].sum()) * n_layers
    (same, *_) = run_ranks(
        world, "tests.actor.workers:routing_step", model_dir=str(model_dir), alloc=alloc, batch=batch
    )
    assert same["ppo_actor/gap/routing/n_pairs"] == n_pairs, "every trained token, every layer, counted once"
    assert same["ppo_actor/gap/routing/topk_match"] >= 0.97, same  # fp32 on both sides: ties aside, identical

    # the servers routed every token of layer 1 elsewhere: the complement of the reference's pair of 4 experts
    other = dict(batch)
    routed = batch["routed_experts"].clone()
    layer1 = routed[..., 2:4]
    complement = [
        [e for e in range(4) if e not in pair] if min(pair) >= 0 else pair for pair in layer1.reshape(-1, 2).tolist()
    ]
    routed[..., 2:4] = torch.tensor(complement, dtype=routed.dtype).view_as(layer1)
    other["routed_experts"] = routed
    (moved, *_) = run_ranks(
        world, "tests.actor.workers:routing_step", model_dir=str(model_dir), alloc=alloc, batch=other
    )
    expected = same["ppo_actor/gap/routing/topk_match"] - 1 / n_layers
    assert moved["ppo_actor/gap/routing/topk_match"] == pytest.approx(expected, abs=0.03), (same, moved)
