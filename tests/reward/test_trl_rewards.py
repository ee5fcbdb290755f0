"""TRL's own reward functions as megarl rewards (``megarl.reward.trl.from_trl``), called as TRL calls them."""

from __future__ import annotations

import pickle

import pytest

from megarl.api import RolloutWorkflow
from megarl.api import context as workflow_context
from megarl.config.base import ConfigError
from megarl.config.rollout import InferenceEngineConfig
from megarl.reward import AsyncRewardWrapper
from megarl.reward.trl import from_trl
from megarl.rollout import RolloutPool
from megarl.utils import stats_tracker
from tests.rollout.sim import SimEngine, SimWorkflow

trl_rewards = pytest.importorskip("trl.rewards", reason="TRL is in the peers extra")

PROMPT = [{"role": "user", "content": "What is 1/3 + 0?"}]


def test_trl_accuracy_reward_reads_the_answer_as_its_solution():
    reward = from_trl(trl_rewards.accuracy_reward, conversational=True)
    row = {"messages": PROMPT, "answer": r"\frac{1}{3}"}
    assert reward("What is 1/3 + 0?", r"My answer is \boxed{\frac{1}{3}}", [1, 2], [3, 4], **row) == 1.0
    assert reward("What is 1/3 + 0?", r"My answer is \boxed{\frac{1}{2}}", [1, 2], [3, 4], **row) == 0.0


def test_trl_think_format_reward_gets_a_conversational_completion():
    reward = from_trl(trl_rewards.think_format_reward, conversational=True)
    assert reward("q", "<think>\nadd\n</think>\n1/3", [1], [2], answer="1/3") == 1.0
    assert reward("q", "1/3", [1], [2], answer="1/3") == 0.0


def completion_length(completions, completion_ids, **kwargs):
    """A TRL-style reward on plain completions: keyword arguments, lists in, a list out."""
    assert all(isinstance(c, str) for c in completions) and "solution" in kwargs and "answer" in kwargs
    return [float(len(ids)) for ids in completion_ids]


def no_score(completions, **kwargs):
    return [None]


def test_plain_completions_and_every_column_come_as_lists():
    reward = from_trl(completion_length)
    assert reward("2+2=", "4", [7, 8], [9, 10, 11], answer="4") == 3.0


def test_a_none_score_counts_as_zero_and_the_reward_pickles():
    assert from_trl(no_score)("p", "c", [], [], answer="a") == 0.0
    reward = pickle.loads(pickle.dumps(from_trl(trl_rewards.accuracy_reward, conversational=True)))
    assert reward.__name__ == "accuracy_reward"


def test_a_config_names_a_trl_reward_and_the_check_accepts_it(tmp_path, monkeypatch):
    from megarl.config import GRPOConfig
    from megarl.run.prelaunch import build_config

    (tmp_path / "my_trl_rewards.py").write_text(
        "from trl.rewards import accuracy_reward\n"
        "from megarl.reward.trl import from_trl\n"
        "accuracy = from_trl(accuracy_reward, conversational=True)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = build_config(GRPOConfig, ["configs/arithmetic_grpo_cpu.yaml"], ["reward_fn=my_trl_rewards.accuracy"])
    assert config.reward_fn.endswith("accuracy")


def test_trl_rewards_get_messages_on_a_chat_row_without_being_told():
    """TRL decides from the data (``is_conversational``): a row whose ``messages`` is a chat."""
    row = {"messages": PROMPT, "answer": r"\frac{1}{3}"}
    accuracy, think = from_trl(trl_rewards.accuracy_reward), from_trl(trl_rewards.think_format_reward)
    assert accuracy("What is 1/3 + 0?", r"My answer is \boxed{\frac{1}{3}}", [1], [2], **row) == 1.0
    assert think("What is 1/3 + 0?", "<think>\nadd\n</think>\n1/3", [1], [2], **row) == 1.0
    assert think("What is 1/3 + 0?", "1/3", [1], [2], **row) == 0.0


def prompt_and_completion_shapes(prompts, completions, **kwargs):
    """A TRL-style reward that reports what it was handed: 1 for message lists, 0 for text."""
    conversational = isinstance(prompts[0], list) and completions[0] == [{"role": "assistant", "content": "4"}]
    assert conversational or (isinstance(prompts[0], str) and completions == ["4"]), (prompts, completions)
    return [float(conversational)]


def test_a_plain_row_gets_text_and_the_flag_overrides_the_data():
    plain = {"question": "2+2=", "answer": "4"}
    chat = {"messages": [{"role": "user", "content": "2+2="}], "answer": "4"}
    shapes = from_trl(prompt_and_completion_shapes)
    assert shapes("2+2=", "4", [1], [2], **plain) == 0.0 and shapes("2+2=", "4", [1], [2], **chat) == 1.0
    assert from_trl(prompt_and_completion_shapes, conversational=False)("2+2=", "4", [1], [2], **chat) == 0.0
    assert from_trl(prompt_and_completion_shapes, conversational=True)("2+2=", "4", [1], [2], **plain) == 1.0
    repetition = from_trl(trl_rewards.get_repetition_penalty_reward(ngram_size=2))
    for row in (plain, chat):  # TRL's own token-id rewards take either
        assert repetition("2+2=", "4 4 4", [1], [5, 5, 5, 5], **row) == pytest.approx(-2 / 3)


def step_and_logging(completions, trainer_state, log_metric, log_extra, **kwargs):
    """A user's TRL reward shaped by the run's progress, logging as TRL lets it."""
    log_metric("seen_step", trainer_state.global_step)
    log_extra("length", [len(completions[0][0]["content"])])
    log_extra("note", ["text is not kept"])
    return [trainer_state.global_step + trainer_state.max_steps / 100 + (trainer_state.epoch or 0) / 1000]


class _ScoredEpisode(RolloutWorkflow):
    """The simulated engine's episode, scored by ``reward`` in its worker processes."""

    def __init__(self, reward: AsyncRewardWrapper):
        self.reward = reward

    async def arun_episode(self, engine, data):
        traj = await SimWorkflow().arun_episode(engine, {"id": 0, "chunk_delays": [0.001]})
        messages = [{"role": "user", "content": "2+2="}]
        traj["rewards"][0] = float(await self.reward("2+2=", "four", [1], [2], messages=messages, answer="4"))
        return traj


def test_a_reward_in_its_worker_sees_the_runs_step_and_its_metrics_reach_the_stats(monkeypatch):
    """The pool's version (training steps finished) is ``trainer_state.global_step``; ``log_metric`` and
    ``log_extra``'s numbers come back from the worker to ``rollout/reward/logged/<name>``."""
    monkeypatch.setattr(workflow_context, "_RUN_LENGTH", workflow_context.RunLength(total_steps=40, steps_per_epoch=4))
    engine = SimEngine()
    engine.version = 6  # six steps trained
    pool = RolloutPool(engine, InferenceEngineConfig(), 1).start()
    reward = AsyncRewardWrapper(from_trl(step_and_logging), timeout_seconds=60, max_workers=1)
    try:
        stats_tracker.export(local=True)  # start clean
        traj = pool.rollout_batch([{"id": 0}], _ScoredEpisode(reward))
        stats = stats_tracker.export(local=True)
    finally:
        reward.close()
        pool.destroy()
    assert traj["rewards"].tolist() == [pytest.approx(6 + 0.4 + 1.5 / 1000)]  # epoch 6/4
    assert stats["rollout/reward/logged/seen_step"] == 6.0 and stats["rollout/reward/logged/length"] == 4.0
    assert not any("note" in key for key in stats), "log_extra keeps numbers only"


def needs_an_expected_column(completions, expected, **kwargs):
    return [float(completions[0][0]["content"] == expected[0])]


def test_the_config_check_calls_a_trl_reward_and_names_what_failed(tmp_path, monkeypatch):
    """The check calls the reward on the first row with a stand-in completion (the row's answer): a TRL
    reward reading ``trainer_state`` passes, one needing a column the rows lack is refused, named."""
    from megarl.config import GRPOConfig
    from megarl.run.prelaunch import build_config

    (tmp_path / "my_step_rewards.py").write_text(
        "from megarl.reward.trl import from_trl\n"
        "from tests.reward.test_trl_rewards import needs_an_expected_column, step_and_logging\n"
        "by_step = from_trl(step_and_logging)\n"
        "broken = from_trl(needs_an_expected_column)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = build_config(GRPOConfig, ["configs/arithmetic_grpo_cpu.yaml"], ["reward_fn=my_step_rewards.by_step"])
    assert config.reward_fn.endswith("by_step")
    with pytest.raises(ConfigError) as info:
        build_config(GRPOConfig, ["configs/arithmetic_grpo_cpu.yaml"], ["reward_fn=my_step_rewards.broken"])
    message = info.value.message
    assert info.value.key == "reward_fn" and "my_step_rewards.broken" in message, message
    assert "the dataset's first row with the stand-in completion" in message, message
    assert "TypeError" in message and "expected" in message, message
