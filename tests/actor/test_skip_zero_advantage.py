"""Rows of zero advantage left out of the update (``actor.skip_zero_advantage``).

A GRPO group whose samples got the same reward has advantage 0 on every token: its clipped
surrogate and gradient are exactly zero. ``drop_inert_rows`` leaves such rows out of the
forward and backward but keeps their tokens in the loss normaliser, so the loss and every
gradient equal those of the full mini-batch; with no row left anywhere only the optimizer
steps (Adam on zero gradients: weight decay alone).
"""

from __future__ import annotations

import pytest
import torch

from megarl.actor.ppo import inert_rows, padded_as_packed, ppo_loss_weight
from megarl.config.ppo import PPOActorConfig
from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_grouped_batch

GROUP = 2
# The two passes pack different tokens (65 vs 36 here), so every fp32 GEMM blocks and orders its sums
# differently, and differently again on each CPU: the gradients agree to rounding (up to 1.6e-6 of the
# largest seen), with the same 1e-4 as the parallel layouts' parity. A row wrongly dropped or kept out of
# the normaliser moves them by that row's share of the gradient, orders of magnitude more.
GRAD_RTOL = 1e-4


def grouped_batch(rewards: list[float]) -> dict:
    batch = make_grouped_batch(len(rewards) // GROUP, GROUP, prompt_len=5, seed=4)
    batch["rewards"] = torch.tensor(rewards)
    batch["logprobs"] = batch["logprobs"] - 0.3 * torch.rand(batch["logprobs"].shape)  # behaviour != current policy
    return batch


def assert_same_update(out: dict) -> None:
    full, skip = out["full"], out["skip"]
    assert skip["loss"] == pytest.approx(full["loss"], abs=1e-7, rel=1e-6)
    assert skip["loss_weight"] == pytest.approx(full["loss_weight"])
    scale = full["grads"].abs().max()
    assert scale > 1e-6  # a real gradient, not two zeros
    assert (skip["grads"] - full["grads"]).abs().max() <= GRAD_RTOL * scale


@pytest.mark.multiproc
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_same_loss_and_gradients_without_the_zero_advantage_rows(tiny_model_dir, agg):
    # groups 0 and 2 all-wrong / all-right: their 4 rows have advantage 0
    batch = grouped_batch([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    out = run_ranks(
        1,
        "tests.actor.workers:inert_row_paths",
        model_dir=str(tiny_model_dir("llama")),
        alloc="d1p1t1",
        batch=batch,
        loss_agg_mode=agg,
    )[0]
    assert out["skip"]["n_inert"] == 4 and out["skip"]["n_active"] == 4
    assert out["skip"]["packed_tokens"] < out["full"]["packed_tokens"]
    assert_same_update(out)
    assert out["step"]["skipped_seqs"] == 4


@pytest.mark.multiproc
def test_a_rank_with_only_zero_advantage_rows_keeps_one(tiny_model_dir):
    # DP 2 takes groups 0, 2 on rank 0 (both uniform) and 1, 3 on rank 1
    batch = grouped_batch([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    outs = run_ranks(
        2, "tests.actor.workers:inert_row_paths", model_dir=str(tiny_model_dir("llama")), alloc="d2p1t1", batch=batch
    )
    # rank 0 runs its shortest row with an empty loss mask: no loss, weight or statistics of its own
    assert [o["skip"]["n_inert"] for o in outs] == [4, 0]
    assert outs[0]["skip"]["n_active"] == 1
    for out in outs:
        assert_same_update(out)


@pytest.mark.multiproc
def test_nothing_to_learn_steps_the_optimizer_only(tiny_model_dir):
    batch = grouped_batch([1.0, 1.0, 0.0, 0.0])
    out = run_ranks(
        1, "tests.actor.workers:inert_row_paths", model_dir=str(tiny_model_dir("llama")), alloc="d1p1t1", batch=batch
    )[0]
    assert out["skip"]["n_active"] == 0 and out["skip"]["packed_tokens"] == 0
    assert out["full"]["grads"].abs().max() == 0  # what the pass it saves would have computed
    assert out["skip"]["grads"].abs().max() == 0
    assert out["skip"]["loss_weight"] == pytest.approx(out["full"]["loss_weight"])
    assert out["step"]["n_mbs"] == 0 and out["step"]["skipped_seqs"] == 4
    # Adam's first step on zero gradients moves nothing; decoupled weight decay shrinks the decayed
    # weights (Megatron spares norms and biases) by lr * wd
    before, after = out["params_before"], out["params_after"]
    moved = ~torch.isclose(after, before, rtol=5e-6, atol=0)
    decayed = torch.isclose(after, before * (1 - 1e-3 * 0.01), rtol=1e-6, atol=0) & moved
    kept = after == before
    assert bool((decayed | kept).all())
    assert decayed.float().mean() > 0.9


@pytest.mark.parametrize(
    ("overrides", "skips"),
    [
        ({}, True),
        ({"skip_zero_advantage": False}, False),
        ({"entropy_coeff": 0.01}, False),  # the entropy bonus pulls on every row
        ({"kl_ctl": 0.1}, False),  # so does a KL loss
        ({"kl_ctl": 0.1, "kl_in_reward": True}, True),  # a KL reward is in the advantages already
    ],
)
def test_which_rows_are_inert(overrides, skips):
    data = {
        "attention_mask": torch.ones(3, 4, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]]),
        "advantages": torch.tensor([[5.0, 0, 0, 0], [0, 0, 0.5, 0], [1.0, 1, 1, 1]]),
    }
    got = inert_rows(data, PPOActorConfig(**overrides)).tolist()
    # row 0: nonzero advantage only outside its loss mask; row 2: no loss token at all
    assert got == ([True, False, True] if skips else [False, False, False])


def test_loss_weight_of_padded_rows_matches_packing():
    from megarl.actor.packing import pack, pack_units

    data = {
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0]], dtype=torch.int32),
        "input_ids": torch.arange(10).view(2, 5),
    }
    (mb,) = pack(data, [pack_units(data, 64, False)], 16)
    for mode in ("token-mean", "seq-mean-token-mean"):
        assert ppo_loss_weight(padded_as_packed(data), mode) == ppo_loss_weight(mb.data, mode)
