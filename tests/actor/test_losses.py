"""Every policy-loss variant against values computed by hand."""

import math

import pytest
import torch

from megarl.actor.losses import aggregate, clipped_surrogate, kl_penalty, policy_loss
from megarl.config.ppo import RolloutCorrectionConfig
from tests.numerics import assert_within, ppo_token_relative_error, unit_roundoff

T = torch.tensor


def test_clipped_surrogate_by_hand():
    ratio = T([0.5, 1.0, 1.5, 1.5, 0.5, 3.0])
    adv = T([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    loss, clipped, dual = clipped_surrogate(ratio, adv, eps_clip=0.2)
    # A>0: max(-A r, -A clip(r)) -> r=0.5: max(-0.5, -0.8) = -0.5 (unclipped); r=1.5: max(-1.5, -1.2) = -1.2 (clipped)
    # A<0: r=1.5: max(1.5, 1.2) = 1.5; r=0.5: max(0.5, 0.8) = 0.8 (clipped); r=3: max(3, 1.2) = 3
    assert torch.allclose(loss, T([-0.5, -1.0, -1.2, 1.5, 0.8, 3.0]))
    assert clipped.tolist() == [False, False, True, False, True, False]
    assert not dual.any()


def test_asymmetric_clip_higher():
    loss, clipped, _ = clipped_surrogate(T([1.25, 1.25, 0.7]), T([1.0, 1.0, -1.0]), eps_clip=0.2, eps_clip_higher=0.28)
    # upper bound 1.28 leaves r=1.25 unclipped; lower bound stays 0.8: r=0.7, A<0 -> max(0.7, 0.8) = 0.8
    assert torch.allclose(loss, T([-1.25, -1.25, 0.8]))
    assert clipped.tolist() == [False, False, True]
    loss_sym, clipped_sym, _ = clipped_surrogate(T([1.25]), T([1.0]), eps_clip=0.2)
    assert torch.allclose(loss_sym, T([-1.2])) and clipped_sym.item()


def test_dual_clip_bounds_negative_advantages_only():
    loss, _, dual = clipped_surrogate(T([5.0, 2.0, 5.0]), T([-2.0, -2.0, 2.0]), eps_clip=0.2, c_clip=3.0)
    # A=-2, r=5: max(10, 2.4) = 10 > -c*A = 6 -> 6; r=2: max(4, 2.4) = 4 <= 6 -> 4; A>0 untouched: max(-10,-2.4) = -2.4
    assert torch.allclose(loss, T([6.0, 4.0, -2.4]))
    assert dual.tolist() == [True, False, False]


def test_policy_loss_plain_ppo_masks_prompt_tokens():
    logp = T([-1.0, -1.0, math.log(0.6), math.log(0.3)])
    old = T([-5.0, -5.0, math.log(0.5), math.log(0.3)])
    adv = T([9.0, 9.0, 1.0, -1.0])
    out = policy_loss(logp, old, adv, T([0, 0, 1, 1]), eps_clip=0.2)
    # token 2: r = 1.2 -> -1.2 (at the bound, not clipped); token 3: r = 1 -> 1.0
    want = T([0.0, 0.0, -1.2, 1.0], dtype=torch.float64)
    bound = ppo_token_relative_error(logp, old, None, torch.float32, inputs_rounded=True) * want.abs()
    assert_within(out.loss, want, bound, "plain PPO loss")
    assert out.mask.tolist() == [False, False, True, True]
    assert out.behav_weight is None


def test_decoupled_ppo_weights_and_caps_behaviour_ratio():
    logp = T([math.log(0.5), math.log(0.5), math.log(0.5)])
    prox = T([math.log(0.5), math.log(0.25), math.log(0.5)])
    old = T([math.log(0.25), math.log(0.5), math.log(0.05)])
    adv = T([1.0, 1.0, 1.0])
    out = policy_loss(logp, old, adv, T([1, 1, 1]), eps_clip=0.2, proximal_logprobs=prox, behav_imp_weight_cap=5.0)
    # ratios vs proximal: 1, 2 (clipped to 1.2), 1; behaviour weights exp(prox-old): 2, 0.5, 10 (> cap: dropped)
    want = T([2.0, 0.5, 10.0], dtype=torch.float64)  # exp(prox - old): its argument's and its own rounding
    u = unit_roundoff(torch.float32)
    weight_error = (4 + (prox.double() - old.double()).abs() + prox.double().abs() + old.double().abs()) * u
    assert_within(out.behav_weight, want, weight_error * want, "behaviour weights")
    assert out.capped.tolist() == [False, False, True]
    want = T([-2.0, -0.6, 0.0], dtype=torch.float64)
    bound = ppo_token_relative_error(logp, old, prox, torch.float32, inputs_rounded=True) * want.abs()
    assert_within(out.loss, want, bound, "decoupled PPO loss")
    total, weight = aggregate(out.loss, out.mask, "token-mean")
    assert torch.isclose(total / weight, T(-2.6 / 3))  # as AReaL: a capped token still counts in the denominator


@pytest.mark.parametrize("mode", ["none", "mask", "two_sided_mask"])
def test_a_masked_token_whose_behaviour_weight_overflows_has_a_zero_gradient(mode):
    """prox - old = 94 makes exp() inf in fp32: the token is masked (zero loss), and its gradient is 0, not
    the NaN of 0 * inf that would reach every parameter."""
    logp = T([-1.0, -1.2, -0.5]).requires_grad_()
    prox, old = T([-1.0, -1.1, -0.6]), T([-1.1, -1.0, -95.0])
    correction = RolloutCorrectionConfig(mode=mode, upper=5.0) if mode != "none" else None
    out = policy_loss(
        logp,
        old,
        T([1.0, -1.0, 0.5]),
        T([1, 1, 1]),
        eps_clip=0.2,
        proximal_logprobs=prox,
        behav_imp_weight_cap=5.0,
        correction=correction,
    )
    out.loss.sum().backward()
    assert out.capped.tolist() == [False, False, True] and out.loss[2] == 0
    assert torch.isfinite(logp.grad).all() and logp.grad[2] == 0, logp.grad


def test_policy_gradient_flows_only_through_logprobs():
    logp = T([math.log(0.5), math.log(0.5)]).requires_grad_()
    prox = T([math.log(0.5), math.log(0.5)])
    out = policy_loss(logp, T([math.log(0.25)] * 2), T([1.0, -1.0]), T([1, 1]), eps_clip=0.2, proximal_logprobs=prox)
    out.loss.sum().backward()
    # d/dlogp of -w * A * r at r=1 is -w*A: w = 2
    assert torch.allclose(logp.grad, T([-2.0, 2.0]))


def test_gspo_sequence_ratio():
    cu = T([0, 2, 4])
    logp = T([0.0, 0.2, 0.0, -0.4]).requires_grad_()
    old = torch.zeros(4)
    out = policy_loss(
        logp,
        old,
        T([1.0, 1.0, -1.0, -1.0]),
        T([1, 1, 1, 1]),
        eps_clip=0.5,
        importance_sampling_level="sequence",
        cu_seqlens=cu,
    )
    # sequence ratios exp(mean log r): exp(0.1) and exp(-0.2), the same for every token of a sequence
    assert torch.allclose(out.ratio, T([math.exp(0.1)] * 2 + [math.exp(-0.2)] * 2))
    out.loss.sum().backward()
    # unclipped tokens: d(-A * s * exp(lr - sg(lr)))/dlogp = -A * s
    expected = T([-math.exp(0.1)] * 2 + [math.exp(-0.2)] * 2)
    assert torch.allclose(logp.grad, expected)
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        policy_loss(logp, old, old, T([1, 1, 1, 1]), eps_clip=0.2, importance_sampling_level="sequence")


def test_kl_estimators_by_hand():
    logp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    d = math.log(2.0)
    assert torch.allclose(kl_penalty(logp, ref, "k1"), T([d]))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), T([0.5 * d * d]))
    assert torch.allclose(kl_penalty(logp, ref, "k3"), T([0.5 + d - 1.0]))  # ref/p - log(ref/p) - 1
    assert torch.all(kl_penalty(T([-1.0, -2.0]), T([-1.0, -2.0]), "k3") == 0)
    # bounded as verl's low_var_kl: a near-impossible token under the reference neither overflows nor dominates
    far = T([-95.0, -30.0, -1.5]).requires_grad_()
    k3 = kl_penalty(far, T([-1.0, -1.0, -1.0]), "k3")
    k3.sum().backward()
    assert k3[:2].tolist() == [10.0, 10.0] and far.grad[:2].tolist() == [0.0, 0.0]
    assert k3[2].item() == pytest.approx(math.exp(0.5) - 0.5 - 1.0)  # inside the bounds: the estimate itself
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, ref, "k4")


def test_aggregation_modes_by_hand():
    # sequence 0: tokens [1, 2, 3] (mask 1,1,1); sequence 1: tokens [4, 5] (mask 1,0); sequence 2: fully masked
    loss = T([1.0, 2.0, 3.0, 4.0, 5.0, 7.0])
    mask = T([1, 1, 1, 1, 0, 0])
    cu = T([0, 3, 5, 6])
    s, w = aggregate(loss, mask, "token-mean")
    assert (s.item(), w.item()) == (10.0, 4.0)  # (1+2+3+4)/4
    s, w = aggregate(loss, mask, "seq-mean-token-mean", cu)
    assert (s.item(), w.item()) == (2.0 + 4.0, 2.0)  # mean(2, 4) over the 2 non-empty sequences
    s, w = aggregate(loss, mask, "seq-mean-token-sum-norm", cu, norm_len=4)
    assert (s.item(), w.item()) == (6.0 / 4 + 4.0 / 4, 2.0)
    with pytest.raises(ValueError, match="needs norm_len"):
        aggregate(loss, mask, "seq-mean-token-sum-norm", cu)
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        aggregate(loss, mask, "seq-mean-token-mean")


def test_aggregation_is_exact_across_splits():
    """Summing (sum, weight) over micro-batches equals aggregating the whole batch at once."""
    torch.manual_seed(0)
    loss, mask = torch.randn(12), torch.rand(12) > 0.3
    cu = T([0, 5, 9, 12])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole_s, whole_w = aggregate(loss, mask, mode, cu, norm_len=8)
        a_s, a_w = aggregate(loss[:5], mask[:5], mode, T([0, 5]), norm_len=8)
        b_s, b_w = aggregate(loss[5:], mask[5:], mode, T([0, 4, 7]), norm_len=8)
        assert torch.isclose((a_s + b_s) / (a_w + b_w), whole_s / whole_w)
