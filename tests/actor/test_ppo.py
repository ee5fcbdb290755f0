"""MegatronPPOActor end to end: compute_logp → compute_advantages → ppo_update.

At TP1 the first mini-batch's loss equals the pure loss functions applied to the HF
model's logprobs and hand-computed GRPO advantages; at TP2 and DP2 every step's loss,
grad norm and statistics, and the logprobs after the update, equal TP1's.
"""

from __future__ import annotations

import pytest
import torch

from megarl.actor import losses
from megarl.config.ppo import NormConfig
from tests.actor.dist_utils import run_ranks
from tests.actor.test_advantages import group_normalized_bounds
from tests.actor.workers import make_batch
from tests.numerics import assert_within

pytestmark = pytest.mark.multiproc

LENGTHS = [7, 12, 5, 9, 11, 6, 8, 10]


@pytest.fixture(scope="module")
def batch():
    b = make_batch(LENGTHS, seed=1)
    b["rewards"] = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    return b


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tp1(llama_dir, batch):
    return run_ranks(1, "tests.actor.workers:ppo_actor_step", model_dir=str(llama_dir), alloc="d1p1t1", batch=batch)[0]


def _grpo_by_hand(rewards: torch.Tensor, group: int = 2, eps: float = 1e-5) -> torch.Tensor:
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + eps)).flatten()


def test_first_minibatch_loss_matches_pure_functions_on_hf_logprobs(llama_dir, batch, tp1):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    rows = slice(0, 4)  # mini-batch 1 of 2: the first two groups
    ids, attn = batch["input_ids"][rows], batch["attention_mask"][rows]
    with torch.no_grad():
        logits = model(ids, attention_mask=attn).logits.float()
    logp = torch.zeros(ids.shape)
    logp[:, :-1] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.roll(batch["loss_mask"][rows], -1, dims=-1).bool() & attn
    old = torch.roll(batch["logprobs"][rows], -1, dims=-1) * mask
    adv = _grpo_by_hand(batch["rewards"])[:4, None].expand_as(logp) * mask
    # each sequence's group-normalised reward (float32 within its derived bound) at its loss tokens, 0 elsewhere
    exact, bound = group_normalized_bounds(batch["rewards"], 2, eps=1e-5)
    assert_within(tp1["data"]["advantages"][rows], exact[:4, None] * mask, bound[:4, None] * mask, "advantages")
    out = losses.policy_loss(
        logp.flatten(),
        old.flatten(),
        adv.flatten(),
        mask.flatten(),
        eps_clip=0.2,
        proximal_logprobs=(logp * mask).flatten(),
        behav_imp_weight_cap=5.0,
    )
    total, weight = losses.aggregate(out.loss, out.mask, "token-mean")
    # Megatron's model against HF's: two implementations of a four-layer model, whose logprobs differ by
    # more than any one reduction's rounding; this relative tolerance is set by hand, not derived
    assert tp1["stats"][0]["ppo_actor/loss"] == pytest.approx((total / weight).item(), rel=1e-4, abs=1e-9)
    assert tp1["stats"][0]["ppo_actor/importance_weight/avg"] == pytest.approx(1.0)  # on-policy first step


@pytest.mark.parametrize(
    "alloc", ["d1p1t2", "d1p1t1c2", pytest.param("d2p1t1", marks=pytest.mark.slow)]
)  # DP: also test_routing
def test_ppo_update_matches_single_rank(llama_dir, batch, tp1, alloc):
    results = run_ranks(2, "tests.actor.workers:ppo_actor_step", model_dir=str(llama_dir), alloc=alloc, batch=batch)
    for want, got in zip(tp1["stats"], results[0]["stats"]):
        for key in (
            "ppo_actor/loss",
            "ppo_actor/grad_norm",
            "ppo_actor/entropy/avg",
            "ppo_actor/clip_ratio/avg",
            "ppo_actor/importance_weight/avg",
            "ppo_actor/approx_kl/avg",
        ):
            # set by hand, not derived: other layouts of the whole model, and after the first step other
            # weights, since the gradients differ by their reductions' order.
            # abs: the first mini-batch is on-policy, so approx_kl is a mean of fp32 rounding noise
            # (logprobs near -10, one ulp ~1e-6; TP reduces in another order): seen at -1.5e-7 vs 0.
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        counts = [k for k in want if k.endswith("n_tokens") or k.endswith("n_seqs")]
        assert counts and {k: got[k] for k in counts} == {k: want[k] for k in counts}  # no rank counted twice
    dp, group = (2 if alloc.startswith("d2") else 1), 2
    after = torch.zeros_like(tp1["logp_after"])
    for r in results:  # rank r holds groups r::dp (split_groups)
        rows = [g * group + i for g in range(r["dp_rank"], len(LENGTHS) // group, dp) for i in range(group)]
        after[rows] = r["logp_after"]
    assert (after - tp1["logp_after"]).abs().max() <= 1e-4


BATCH_LEVEL = [  # batch-level statistics: over the whole batch, not a rank's share
    {"adv_estimator": "grpo", "adv_norm": NormConfig(mean_level="batch", std_level="batch")},
    {"adv_estimator": "grpo", "adv_norm": NormConfig(mean_level="batch", std_level="group", mean_leave1out=True)},
    {"adv_estimator": "gae", "adv_norm": NormConfig(mean_level="batch", std_level="batch")},
]


def test_batch_level_advantages_do_not_depend_on_the_data_parallel_split(llama_dir, batch):
    """DP2 shares hold 4 rows each, each cut to its own longest row: the batch mean, std and Dr. GRPO's
    padded length are the whole batch's, as on one rank."""
    batch = {**batch, "values": torch.randn(batch["attention_mask"].shape, generator=torch.Generator().manual_seed(3))}
    kwargs = dict(model_dir=str(llama_dir), batch=batch, settings=BATCH_LEVEL)
    (one,) = run_ranks(1, "tests.actor.workers:advantages_on_shares", alloc="d1p1t1", **kwargs)
    two = run_ranks(2, "tests.actor.workers:advantages_on_shares", alloc="d2p1t1", **kwargs)
    shape = batch["attention_mask"].shape
    for i, setting in enumerate(BATCH_LEVEL):
        want = one["advantages"][i]
        got = torch.zeros(shape)
        for r in two:  # rank r holds groups r::2 (split_groups), cut to its own width
            rows = [g * 2 + j for g in range(r["dp_rank"], shape[0] // 2, 2) for j in range(2)]
            got[rows, : r["advantages"][i].shape[1]] = r["advantages"][i]
        # fp32 sums of 8 rewards or ~70 token advantages in another order: a few ulps of values near 1
        assert (got[:, : want.shape[1]] - want).abs().max() <= 1e-5, setting
    assert [r["batch_width"] for r in two] == [one["batch_width"]] * 2 == [max(LENGTHS)] * 2
