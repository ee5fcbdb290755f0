"""Rollout correction (TIS / MIS / IcePop, token and sequence level) against hand-computed values."""

from __future__ import annotations

import math
import re

import pytest
import torch

from megarl.actor import losses, ppo
from megarl.actor.rollout_correction import behaviour_weights
from megarl.config import GRPOConfig
from megarl.config.base import ConfigError
from megarl.config.ppo import PPOActorConfig, RolloutCorrectionConfig
from megarl.run.prelaunch import build_config
from megarl.utils import stats_tracker
from tests.actor.test_fused_flag import _head, _micro_batch
from tests.numerics import assert_within, gamma

# Four tokens in two sequences [0, 2) and [2, 4); the last token is not a loss token.
# Token weights w = exp(prox - behav) = 0.5, 1.5, 3, (1).
BEHAV = torch.zeros(4)
PROX = torch.tensor([math.log(0.5), math.log(1.5), math.log(3.0), 0.7])
MASK = torch.tensor([1, 1, 1, 0])
CU = torch.tensor([0, 2, 4])
SEQ0 = math.sqrt(0.5 * 1.5)  # geometric mean of sequence 0; sequence 1's is 3 (one loss token)


def _weights(mode: str, level: str = "token", upper: float = 2.0, lower: float | None = None):
    config = RolloutCorrectionConfig(mode=mode, level=level, upper=upper, lower=lower)
    return behaviour_weights(PROX, BEHAV, MASK, config, CU)


def _masked(w) -> list:
    return [round(v, 6) if keep else None for v, keep in zip(w.weight.tolist(), w.kept.tolist())]


@pytest.mark.parametrize(
    ("mode", "level", "lower", "weights", "truncated", "masked"),
    [
        ("truncate", "token", None, [0.5, 1.5, 2.0, None], [0, 0, 1, 0], [0, 0, 0, 0]),
        ("mask", "token", None, [0.5, 1.5, None, None], [0, 0, 0, 0], [0, 0, 1, 0]),
        ("two_sided_mask", "token", 0.6, [None, 1.5, None, None], [0, 0, 0, 0], [1, 0, 1, 0]),
        ("two_sided_mask", "token", None, [0.5, 1.5, None, None], [0, 0, 0, 0], [0, 0, 1, 0]),  # lower 1/2
        ("truncate", "sequence", None, [SEQ0, SEQ0, 2.0, None], [0, 0, 1, 0], [0, 0, 0, 0]),
        ("mask", "sequence", None, [SEQ0, SEQ0, None, None], [0, 0, 0, 0], [0, 0, 1, 0]),
        ("two_sided_mask", "sequence", 0.9, [None, None, None, None], [0, 0, 0, 0], [1, 1, 1, 0]),
        ("none", "token", None, [0.5, 1.5, 3.0, None], [0, 0, 0, 0], [0, 0, 0, 0]),
    ],
)
def test_each_mode_matches_hand_computed_weights(mode, level, lower, weights, truncated, masked):
    w = _weights(mode, level, lower=lower)
    assert _masked(w) == [None if x is None else round(x, 6) for x in weights]
    assert w.truncated.int().tolist() == truncated
    assert w.masked.int().tolist() == masked
    assert not (w.kept & ~MASK.bool()).any(), "a token outside the loss mask is never kept"


def test_sequence_level_weight_is_the_geometric_mean_of_loss_tokens_only():
    w = _weights("none", "sequence")
    assert w.raw[:2].tolist() == pytest.approx([SEQ0, SEQ0])
    assert w.raw[2].item() == pytest.approx(3.0), "the non-loss token's logprob gap (0.7) must not count"


def test_policy_loss_applies_the_correction_to_the_decoupled_loss():
    """At logp == prox the ratio is 1 (no clip): each kept token's loss is -A * weight, masked ones 0."""
    adv = torch.tensor([1.0, -2.0, 1.0, 5.0])
    out = losses.policy_loss(
        PROX.clone(),
        BEHAV,
        adv,
        MASK,
        eps_clip=0.2,
        proximal_logprobs=PROX,
        correction=RolloutCorrectionConfig(mode="truncate", upper=2.0),
        cu_seqlens=CU,
    )
    assert out.loss.tolist() == pytest.approx([-0.5, 3.0, -2.0, 0.0])
    assert out.truncated.tolist() == [False, False, True, False]
    out = losses.policy_loss(
        PROX.clone(),
        BEHAV,
        adv,
        MASK,
        eps_clip=0.2,
        proximal_logprobs=PROX,
        correction=RolloutCorrectionConfig(mode="mask", level="sequence", upper=2.0),
        cu_seqlens=CU,
    )
    assert out.loss.tolist() == pytest.approx([-SEQ0, 2 * SEQ0, 0.0, 0.0])
    total, weight = losses.aggregate(out.loss, out.mask, "token-mean")
    assert weight.item() == 3, "masked tokens stay in the denominator"


def test_none_keeps_the_behaviour_weight_cap():
    adv = torch.ones(4)
    capped = losses.policy_loss(
        PROX.clone(),
        BEHAV,
        adv,
        MASK,
        eps_clip=0.2,
        proximal_logprobs=PROX,
        behav_imp_weight_cap=2.0,
        correction=RolloutCorrectionConfig(),
    )
    assert capped.loss.tolist() == pytest.approx([-0.5, -1.5, 0.0, 0.0])
    assert capped.capped.tolist() == [False, False, True, False]


def _mean_gap_and_bound(mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean |prox - behaviour| over the micro-batch's loss tokens, and the bound of the logged one
    against it: each token's gap is the same float32 subtraction in the loss as here, and the mean of
    the n gaps is taken in float64 there and here, each within gamma(n + 1) sum|gap| / n of the exact
    mean of those float32 gaps (n - 1 additions, one division)."""
    mask = mb["loss_mask"].bool() & mb["label_mask"]
    gaps = (mb["prox_logp"] - mb["logprobs"]).abs()[mask].double()
    return gaps.mean(), 2 * gamma(gaps.numel() + 1, torch.float64) * gaps.mean()


def test_the_mean_gap_bound_rejects_an_error_just_above_it():
    """The bound spans some thirty float64 ulps of the mean, too few to plant 1.01 and 0.99 bounds apart:
    the float64 just past it fails, and the one just short of it passes."""
    want, bound = _mean_gap_and_bound(_micro_batch(_head()))
    assert bound > 0
    edge = want + bound
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(torch.nextafter(edge, edge + 1), want, bound, "mean gap just outside")
    assert_within(torch.nextafter(edge, edge - 1), want, bound, "mean gap just inside")


@pytest.mark.parametrize("mode", ["truncate", "mask", "two_sided_mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ppo_loss_logs_the_correction_every_step(mode, level):
    cfg = PPOActorConfig(
        path="unused",
        behav_imp_weight_cap=None,
        rollout_correction=RolloutCorrectionConfig(mode=mode, level=level, upper=1.3),
    )
    cfg.check()
    head = _head()
    mb = _micro_batch(head)
    stats_tracker.export(local=True)
    ppo.ppo_loss(head, mb, cfg, norm_len=64).backward()
    stats = stats_tracker.export(local=True)
    want, bound = _mean_gap_and_bound(mb)
    logged = torch.tensor(stats["rollout_correction/abs_logp_diff/avg"], dtype=torch.float64)
    assert_within(logged, want, bound, "mean gap")
    assert stats["behave_imp_weight/max"] > 1.3, "the batch has weights above the threshold"
    if mode == "truncate":
        assert stats["rollout_correction/truncated/avg"] > 0 and stats["capped_ratio/avg"] == 0
    else:
        assert stats["capped_ratio/avg"] > 0 and stats["rollout_correction/truncated/avg"] == 0
    assert head.hidden.grad.abs().sum() > 0


def test_modes_give_different_losses_from_the_plain_cap():
    head = _head()
    mb = _micro_batch(head)
    losses_by_mode = {}
    for mode in ("none", "truncate", "mask", "two_sided_mask"):
        correction = RolloutCorrectionConfig(mode=mode, upper=1.3)
        cfg = PPOActorConfig(
            path="unused", behav_imp_weight_cap=None if mode != "none" else 1.3, rollout_correction=correction
        )
        losses_by_mode[mode] = ppo.ppo_loss(head, mb, cfg, norm_len=64).item()
    assert losses_by_mode["mask"] == pytest.approx(losses_by_mode["none"]), "MIS at token level is the AReaL cap"
    assert len({round(v, 6) for v in losses_by_mode.values()}) == 3


@pytest.mark.parametrize(
    ("overrides", "key", "why"),
    [
        (["actor.rollout_correction.mode=truncate"], "actor.behav_imp_weight_cap", "set behav_imp_weight_cap: null"),
        (
            ["actor.rollout_correction.mode=mask", "actor.behav_imp_weight_cap=null", "actor.use_decoupled_loss=false"],
            "actor.rollout_correction.mode",
            "use_decoupled_loss: true",
        ),
        (
            [
                "actor.rollout_correction.mode=mask",
                "actor.behav_imp_weight_cap=null",
                "actor.rollout_correction.lower=0.5",
            ],
            "actor.rollout_correction.lower",
            "only two_sided_mask has a lower bound",
        ),
        (
            [
                "actor.rollout_correction.mode=two_sided_mask",
                "actor.behav_imp_weight_cap=null",
                "actor.rollout_correction.lower=1.5",
            ],
            "actor.rollout_correction.lower",
            "must be in [0, 1)",
        ),
        (
            [
                "actor.rollout_correction.mode=truncate",
                "actor.behav_imp_weight_cap=null",
                "actor.rollout_correction.upper=0.5",
            ],
            "actor.rollout_correction.upper",
            "cuts on-policy tokens",
        ),
    ],
)
def test_bad_correction_configs_name_the_key(overrides, key, why):
    with pytest.raises(ConfigError, match=re.escape(why)) as err:
        build_config(GRPOConfig, ["configs/arithmetic_grpo_cpu.yaml"], overrides)
    assert err.value.key == key
