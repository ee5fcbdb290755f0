"""TRL's own reward functions as megarl rewards (``megarl.reward.trl.from_trl``), called as TRL calls them."""

from __future__ import annotations

import pickle

import pytest

from megarl.reward.trl import from_trl

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


def test_a_config_names_a_trl_reward_and_the_check_calls_it_as_the_run_will(tmp_path, monkeypatch):
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
