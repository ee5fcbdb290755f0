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


def test_the_console_names_the_kernel_path_and_a_mainloop_that_failed_its_self_check(monkeypatch):
    """On a GPU the start-up line says which fused-kernel path runs; a fallback (here: a wrong sm90
    kernel, planted as a failing self-check) is on it, naming the mainloop and why. None on a CPU."""
    from megarl.kernels import _cuda, backend
    from megarl.kernels.selfcheck import CheckResult
    from megarl.train import kernel_line

    assert kernel_line("auto") is None or torch.cuda.is_available()
    checks = {
        "sm90": CheckResult("sm90", 0.5, "dz", 40.0, error="dz beyond its tolerance by 40x"),
        "sm80": CheckResult("sm80", 1e-7, "dz", 0.01),
    }
    monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "_current_cuda_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(_cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(_cuda, "_sm90_available", lambda device_index: True)
    monkeypatch.setattr(_cuda, "_CHECKS", {})
    monkeypatch.setattr(_cuda, "_PATHS", {})
    monkeypatch.setattr(_cuda, "_self_check", lambda device, mainloop: checks[mainloop])
    line = kernel_line("auto")
    assert line.startswith("fused kernels: cuda sm80 (verified"), line
    assert "sm90 failed its self-check: dz beyond its tolerance by 40x" in line
    assert kernel_line("torch") is None


def test_step_line_shows_the_failed_rewards():
    """Occasional reward failures (raised, timed out) are on the step's console line, and only then."""
    from megarl.train import step_line

    stats = {"batch/reward/avg": 0.25, "rollout/reward/n_calls": 16.0, "rollout/reward/error": 2.0}
    assert "reward 0.250  failed rewards: 2 errors in 16 calls" in step_line(0, 3, stats)
    stats["rollout/reward/timeout"] = 1.0
    assert "failed rewards: 2 errors, 1 timeout in 16 calls" in step_line(0, 3, stats)
    assert "failed" not in step_line(0, 3, {"batch/reward/avg": 0.25, "rollout/reward/n_calls": 16.0})
