"""GRPO advantage normalisation, reward shaping and GAE against hand-computed values."""

import pytest
import torch

from megarl.actor.advantages import gae, grpo_advantages, last_token_mask, normalize_rewards, shape_rewards

T = torch.tensor


def test_group_mean_and_std():
    rewards = T([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = normalize_rewards(rewards, group_size=4, eps=0.0 + 1e-12)
    # group 0: mean 0.5, std 0.5 -> +-1; group 1: all equal -> 0 (no signal)
    assert torch.allclose(adv, T([1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0]), atol=1e-6)


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
