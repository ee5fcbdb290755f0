"""GRPO advantage normalisation, reward shaping and GAE against hand-computed values."""

import pytest
import torch

from megarl.actor.advantages import gae, grpo_advantages, last_token_mask, normalize_rewards, shape_rewards
from tests.numerics import assert_within, gamma, unit_roundoff

T = torch.tensor


def group_normalized_bounds(rewards: torch.Tensor, group_size: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's advantages ``(r - mean) / (std + eps)`` over groups of ``group_size`` (population std),
    exact (float64), and the bound of each against its float32 computation. With u float32's unit
    roundoff and m the group size, first order in u:

      mean         E_mu  = gamma(m) mean|r|                  (m - 1 additions and a division)
      d = r - mean E_d   = E_mu + u |d|
      variance     E_var = the larger of: two passes, mean(2 |d| E_d) + gamma(m + 1) var (m squares,
                   their sum, a division); one-pass updates (Welford's, as torch's CPU kernel),
                   (m kappa + 1) u var with kappa^2 = 1 + mean^2 / var (Chan, Golub and LeVeque, 1983)
      std          E_sd  = E_var / (2 std) + u std            (a square root)
      std + eps    E_den = E_sd + u eps + u (std + eps)       (eps rounded to float32, then the sum)
      a = d / den  E_a   = E_d / den + |a| E_den / den + u |a|

    A group of equal rewards has no such bound (its deviations are rounding noise over eps); for small
    integer rewards its sum and mean are exact, its deviations exactly 0, and so its advantages: bound 0.
    """
    r = rewards.double().view(-1, group_size)
    u, m = unit_roundoff(torch.float32), group_size
    mean = r.mean(dim=1, keepdim=True)
    d = r - mean
    var = (d * d).mean(dim=1, keepdim=True)
    std = var.sqrt()
    den = std + eps
    a = d / den
    e_d = gamma(m, torch.float32) * r.abs().mean(dim=1, keepdim=True) + u * d.abs()
    kappa = (1 + mean**2 / var).sqrt()
    two_pass = (2 * d.abs() * e_d).mean(dim=1, keepdim=True) + gamma(m + 1, torch.float32) * var
    e_var = torch.maximum(two_pass, (m * kappa + 1) * u * var)
    e_den = e_var / (2 * std) + u * std + u * (eps + den)
    e_a = e_d / den + a.abs() * e_den / den + u * a.abs()
    uniform = (var == 0).expand_as(r)
    small_integers = torch.equal(r[uniform], r[uniform].round()) and bool((r[uniform].abs() * m < 2**24).all())
    if not small_integers:
        raise ValueError("a group of equal rewards that are not small integers has no float32 error bound")
    return a.flatten(), torch.where(uniform, 0.0, e_a).flatten()


def test_group_mean_and_std():
    rewards = T([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = normalize_rewards(rewards, group_size=4, eps=0.0 + 1e-12)
    # group 0: mean 0.5, std 0.5 -> +-1 (less 2e-12 for eps); group 1: all equal -> 0 (no signal)
    exact, bound = group_normalized_bounds(rewards, 4, 1e-12)
    assert torch.allclose(exact, T([1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    assert_within(adv, exact, bound, "advantages")


def test_the_derived_bound_rejects_an_error_just_above_it():
    """The bound holds where the float32 computation rounds, and an error of 1.01 bounds in any
    advantage fails it while 0.99 passes."""
    rewards = T([1.0, 0.0, 0.0, 3.0, 1.0, 1.0, 1.0, 1.0])
    exact, bound = group_normalized_bounds(rewards, 4, 1e-5)
    assert bound[:4].min() > 0 and not bound[4:].any()
    assert_within(normalize_rewards(rewards, 4, eps=1e-5), exact, bound, "advantages")  # a group that rounds
    for at in range(4):
        planted = exact.clone()
        planted[at] += 1.01 * bound[at]
        with pytest.raises(AssertionError, match="advantages: 1 of 8"):
            assert_within(planted, exact, bound, "advantages")
        planted[at] -= 0.02 * bound[at]
        assert_within(planted, exact, bound, "advantages")


def test_batch_level_and_dr_grpo():
    rewards = T([1.0, 0.0, 1.0, 1.0])
    batch = normalize_rewards(rewards, 2, mean_level="batch", std_level="batch", eps=0.0)
    mean, std = 0.75, (0.1875) ** 0.5
    assert torch.allclose(batch, (rewards - mean) / std)
    dr = normalize_rewards(rewards, 2, mean_level="group", std_level="none")
    assert torch.allclose(dr, T([0.5, -0.5, 0.0, 0.0]))
    raw = normalize_rewards(rewards, 2, mean_level="none", std_level="none")
    assert torch.equal(raw, rewards)


def test_leave_one_out_baseline():
    adv = normalize_rewards(T([1.0, 0.0, 0.0, 2.0]), 4, std_level="none", leave_one_out=True)
    # baselines: (0+0+2)/3, (1+0+2)/3, (1+0+2)/3, (1+0+0)/3
    assert torch.allclose(adv, T([1 - 2 / 3, -1.0, -1.0, 2 - 1 / 3]))
    with pytest.raises(ValueError, match="at least 2 samples"):
        normalize_rewards(T([1.0, 2.0]), 1, std_level="none", leave_one_out=True)


def test_bad_group_sizes_are_named():
    with pytest.raises(ValueError, match="5 rewards do not split into groups of group_size=2"):
        normalize_rewards(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="unknown normalisation level 'prompt'"):
        normalize_rewards(torch.zeros(4), 2, mean_level="prompt")


def test_shape_rewards():
    assert torch.equal(shape_rewards(T([0.0, 1.0, 10.0]), bias=-0.5, scaling=2.0, clip=5.0), T([-1.0, 1.0, 5.0]))


def test_grpo_advantages_broadcast_to_loss_tokens():
    # two sequences of a group of 2: [p p c c] and [p c c c]
    mask = T([0, 0, 1, 1, 0, 1, 1, 1])
    cu = T([0, 4, 8])
    adv = grpo_advantages(T([1.0, 0.0]), mask, cu, group_size=2, std_level="none")
    assert torch.allclose(adv, T([0, 0, 0.5, 0.5, 0, -0.5, -0.5, -0.5]))


def test_kl_in_reward_adds_return_to_go_of_penalties():
    mask = T([0, 1, 1, 1])
    cu = T([0, 4])
    kl_rewards = T([0.0, -0.1, -0.2, -0.3])
    adv = grpo_advantages(
        T([1.0]), mask, cu, group_size=1, mean_level="none", std_level="none", kl_token_rewards=kl_rewards
    )
    assert torch.allclose(adv, T([0.0, 1 - 0.6, 1 - 0.5, 1 - 0.3]))


def test_gae_by_hand():
    rewards = T([0.0, 0.0, 1.0, 0.0, 2.0])
    values = T([0.5, 0.5, 0.5, 1.0, 1.0])
    mask = T([1, 1, 1, 1, 1])
    cu = T([0, 3, 5])
    adv, ret = gae(rewards, values, mask, cu, gamma=0.9, lam=0.5)
    # seq 0: d2 = 1 - 0.5 = 0.5; d1 = 0 + 0.9*0.5 - 0.5 = -0.05; d0 = -0.05
    #   A2 = 0.5; A1 = -0.05 + 0.45*0.5 = 0.175; A0 = -0.05 + 0.45*0.175 = 0.02875
    # seq 1: d4 = 2 - 1 = 1; d3 = 0 + 0.9*1 - 1 = -0.1; A4 = 1; A3 = -0.1 + 0.45 = 0.35
    assert torch.allclose(adv, T([0.02875, 0.175, 0.5, 0.35, 1.0]))
    assert torch.allclose(ret, adv + values)


def test_gae_skips_masked_tokens_and_zero_critic_is_return_to_go():
    rewards = T([5.0, 1.0, 2.0, 3.0])
    adv, _ = gae(rewards, None, T([0, 1, 1, 1]), T([0, 4]))
    assert torch.allclose(adv, T([0.0, 6.0, 5.0, 3.0]))


def test_last_token_mask():
    mask = T([0, 1, 1, 0, 0, 1, 0, 0])
    assert last_token_mask(mask, T([0, 4, 7, 8])).tolist() == [False, False, True, False, False, True, False, False]
