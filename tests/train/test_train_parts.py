"""Small parts of the trainer entry: dynamic filtering and the reward import."""

from __future__ import annotations

import pytest
import torch

from megarl.train import import_object, should_accept_fn


def test_uniform_reward_filter_rejects_groups_without_signal():
    accept = should_accept_fn("uniform_reward")
    assert accept({"rewards": torch.tensor([1.0, 0.0, 1.0, 1.0])})
    assert not accept({"rewards": torch.tensor([1.0, 1.0, 1.0, 1.0])})
    assert not accept({"rewards": torch.tensor([0.0, 0.0])})
    assert not accept({"rewards": torch.tensor([1.0])}), "a group of one has no baseline to learn against"
    assert should_accept_fn("none") is None


def test_reward_fn_import_errors_name_the_setting():
    from megarl.reward.gsm8k import gsm8k_reward_fn

    assert import_object("megarl.reward.gsm8k.gsm8k_reward_fn", "reward_fn") is gsm8k_reward_fn
    with pytest.raises(ValueError, match="reward_fn='megarl.reward.nope.fn' cannot be imported"):
        import_object("megarl.reward.nope.fn", "reward_fn")
    with pytest.raises(ValueError, match="reward_fn='megarl.reward.gsm8k.missing'"):
        import_object("megarl.reward.gsm8k.missing", "reward_fn")
