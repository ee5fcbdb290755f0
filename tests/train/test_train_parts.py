"""Small parts of the trainer entry: the rollout filter, the plug-in import, closing the workflows."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megarl.config.base import ConfigError
from megarl.config.ppo import PPOActorConfig
from megarl.train import close, should_accept_fn
from megarl.utils.plugins import import_plugin
from megarl.workflow import GroupedRolloutWorkflow


def _group(rewards: list[float]) -> dict:
    return {"rewards": torch.tensor(rewards), "attention_mask": torch.ones(len(rewards), 3)}


def test_uniform_reward_filter_rejects_groups_without_signal():
    accept = should_accept_fn("uniform_reward", 4)
    assert accept(_group([1.0, 0.0, 1.0, 1.0]))
    assert not accept(_group([1.0, 1.0, 1.0, 1.0]))
    assert not should_accept_fn("uniform_reward", 2)(_group([0.0, 0.0]))
    assert not should_accept_fn("uniform_reward", 1)(_group([1.0])), "a group of one has no baseline to learn against"
    assert should_accept_fn("none", 4)(_group([1.0, 1.0, 1.0, 1.0]))


def test_uniform_reward_filter_judges_the_shaped_rewards():
    """Rewards 25, 30, 21 and 40 differ, but clipped at 20 they are one reward: no advantage, dropped."""
    actor = PPOActorConfig(path="unused", reward_clip=20.0)
    assert not should_accept_fn("uniform_reward", 4, actor=actor)(_group([25.0, 30.0, 21.0, 40.0]))
    assert should_accept_fn("uniform_reward", 4, actor=actor)(_group([25.0, 30.0, 21.0, 10.0]))


def test_a_grouped_rollout_with_a_rejected_run_rejects_the_prompt(caplog):
    """workflow.group_size=2 of 2 samples: one run rejected leaves 2 of 4 rows, a prompt not to train on."""
    accept = should_accept_fn("none", 4, runs=2)
    assert not accept(_group([1.0, 0.0])) and not accept(_group([1.0, 1.0]))
    assert caplog.text.count("returned 2 of 4 trajectories for a prompt (1 of its workflow.group_size=2") == 1
    assert accept(_group([1.0, 0.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="returned 3 trajectories for one prompt"):  # not whole runs: a bug
        accept(_group([1.0, 0.0, 1.0]))


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


class _Closing:
    """A workflow with reward workers or a proxy to stop: ``close`` notes it in ``closed``."""

    def __init__(self, closed: list):
        self.closed = closed

    async def arun_episode(self, engine, data):
        return None

    def close(self) -> None:
        self.closed.append(self)


class _NotebookWorkflow:
    """The contract's least: ``arun_episode`` only, no ``close``."""

    async def arun_episode(self, engine, data):
        return None


@pytest.mark.parametrize("eval_workflow", [None, _NotebookWorkflow()], ids=["no-eval", "eval-without-close"])
def test_closing_the_trainer_closes_a_grouped_workflow_and_skips_one_without_close(eval_workflow):
    closed, destroyed = [], []
    inner = _Closing(closed)
    t = SimpleNamespace(
        stats_logger=None,
        workflow=GroupedRolloutWorkflow(inner, 4),
        eval_workflow=eval_workflow,
        rollout=SimpleNamespace(destroy=lambda: destroyed.append("rollout")),
        actor=SimpleNamespace(destroy=lambda: destroyed.append("actor")),
        critic=None,
    )
    close(t)
    assert closed == [inner], "the grouped workflow closes its inner one"
    assert destroyed == ["rollout", "actor"]


KEPT_HEAP = """
import contextlib, json, sys, types
import torch
from megarl import train
from megarl.utils import stats_tracker
from megarl.utils.memory import PeakRSS, keep_freed_memory

kept = sys.argv[1] == "kept" and keep_freed_memory()  # as the CPU trainer's main() does
t = types.SimpleNamespace(
    config=types.SimpleNamespace(device="cpu"),
    memory=PeakRSS(),
    threads=types.SimpleNamespace(phase=lambda servers_paused: contextlib.nullcontext()),
)
for name in ("first", "second"):
    with train.phase(t, name):  # activations of both kinds: 64 MiB tensors (glibc would mmap them) and small ones
        blocks = [torch.ones(16 << 20) for _ in range(4)] + [torch.ones(16384) for _ in range(4096)]
        del blocks
stats = stats_tracker.export()
print(json.dumps({"kept": kept, **{name: stats[f"memory/{name}_page_faults"] for name in ("first", "second")}}))
"""


def _phase_faults(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", KEPT_HEAP, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cpu_trainer_phase_reuses_the_memory_the_last_one_freed():
    """With the CPU trainer's heap policy (``keep_freed_memory``) a phase reuses the pages the one before
    freed instead of faulting them in anew (600,000 faults per bf16 train phase of the arithmetic job
    before); each phase's minor page faults are in its stats (``memory/<phase>_page_faults``)."""
    kept, default = _phase_faults("kept"), _phase_faults("default")
    pages = 512 * 2**20 / 4096  # 256 MiB of large tensors and 256 MiB of small ones
    assert kept["kept"], "glibc's mallopt took the settings"
    assert kept["first"] > pages / 2 and default["first"] > pages / 2, (kept, default)  # touched as new pages
    assert kept["second"] < kept["first"] / 10, kept
    assert default["second"] > pages / 8, default  # glibc's default: the large tensors' pages come anew
