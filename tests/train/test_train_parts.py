"""Small parts of the trainer entry: the rollout filter and the plug-in import."""

from __future__ import annotations

import pytest
import torch

from megarl.config.base import ConfigError
from megarl.train import should_accept_fn
from megarl.utils.plugins import import_plugin


def _group(rewards: list[float]) -> dict:
    return {"rewards": torch.tensor(rewards), "attention_mask": torch.ones(len(rewards), 3)}


def test_uniform_reward_filter_rejects_groups_without_signal():
    accept = should_accept_fn("uniform_reward", 4)
    assert accept(_group([1.0, 0.0, 1.0, 1.0]))
    assert not accept(_group([1.0, 1.0, 1.0, 1.0]))
    assert not should_accept_fn("uniform_reward", 2)(_group([0.0, 0.0]))
    assert not should_accept_fn("uniform_reward", 1)(_group([1.0])), "a group of one has no baseline to learn against"
    assert should_accept_fn("none", 4)(_group([1.0, 1.0, 1.0, 1.0]))


def test_a_workflow_returning_another_group_size_fails_naming_the_keys():
    with pytest.raises(ValueError, match=r"returned 3 trajectories for one prompt, but a GRPO group here is 4"):
        should_accept_fn("none", 4)(_group([1.0, 0.0, 1.0]))


def test_plugin_import_errors_name_the_setting():
    from megarl.reward.gsm8k import gsm8k_reward_fn

    assert import_plugin("megarl.reward.gsm8k.gsm8k_reward_fn", "reward_fn") is gsm8k_reward_fn
    with pytest.raises(ConfigError, match=r"'reward_fn'.*cannot import module 'megarl.reward.nope'"):
        import_plugin("megarl.reward.nope.fn", "reward_fn")
    with pytest.raises(ConfigError, match=r"'reward_fn'.*has no attribute 'missing'"):
        import_plugin("megarl.reward.gsm8k.missing", "reward_fn")
    with pytest.raises(ConfigError, match="not of the form 'package.module.name'"):
        import_plugin("gsm8k_reward_fn", "reward_fn")
