"""Arithmetic reward: the final number (last boxed, else last anywhere) against the integer answer."""

from __future__ import annotations

import asyncio
import pickle
from fractions import Fraction

import pytest

from megarl.reward import AsyncRewardWrapper
from megarl.reward.arithmetic import arithmetic_reward, arithmetic_reward_fn, final_number

# (completion, answer, expected reward) -- completions in the style SmolLM2-135M writes
CASES = [
    ("56", "56", 1.0),
    ("7 * 8 = 56", "56", 1.0),
    ("7 * 8 = 56.", "56", 1.0),
    ("The final answer is 56.", "56", 1.0),
    ("To multiply 7 by 8, we get 56", "56", 1.0),
    ("7 * 8 = 54", "56", 0.0),
    ("7 * 8 = 56, not 54", "56", 0.0),  # the last number counts
    ("First 54, then corrected: 56", "56", 1.0),
    ("I cannot compute that.", "56", 0.0),  # no number
    ("", "56", 0.0),
    ("fifty-six", "56", 0.0),  # words do not count
    ("\\boxed{56}", "56", 1.0),
    ("\\boxed{56} since 7 * 8 is 56 and not 57", "56", 1.0),  # a box wins over later numbers
    ("\\boxed{54} wait \\boxed{56}", "56", 1.0),  # the last box
    ("\\boxed{} is 56", "56", 1.0),  # an empty box: back to the last number
    ("\\boxed{x = 56}", "56", 1.0),
    ("56.0", "56", 1.0),
    ("56.5", "56", 0.0),
    ("9 - 3 = 6", "6", 1.0),
    ("Calculate 8 - 4", "4", 1.0),  # a binary minus is no sign (the 4 counts, as written)
    ("3 - 5 = -2", "-2", 1.0),
    ("3 - 5 = \u22122", "-2", 1.0),  # unicode minus
    ("3 - 5 = 2", "-2", 0.0),  # sign matters
    ("9-3=6", "6", 1.0),
    ("0 + 0 = 0", "0", 1.0),
    ("The answer is -0", "0", 1.0),
    ("1,000", "1000", 1.0),
    ("1, 2, 3", "3", 1.0),  # a list, not a thousands group
]


@pytest.mark.parametrize("completion, answer, expected", CASES)
def test_reward(completion, answer, expected):
    assert arithmetic_reward(completion, answer) == expected


@pytest.mark.parametrize(
    "completion, number",
    [("7 * 8 = 56", Fraction(56)), ("= -3.", Fraction(-3)), ("2.5", Fraction(5, 2)), ("none", None)],
)
def test_final_number(completion, number):
    assert final_number(completion) == number


@pytest.mark.parametrize(
    "completion, answer, outcome",
    [
        ("56", "56", "correct"),
        ("55", "56", "incorrect"),
        ("no idea", "56", "no_answer"),
        ("56", "n/a", "bad_reference"),
    ],
)
def test_outcome_says_how_the_reward_was_decided(completion, answer, outcome):
    assert arithmetic_reward(completion, answer).outcome == outcome


def test_reward_fn_has_areal_signature_and_ignores_other_columns():
    reward = arithmetic_reward_fn("prompt", "7 * 8 = 56", [1, 2], [3, 4], answer="56", a=7, op="*", b=8, messages=[])
    assert reward == 1.0 and reward.outcome == "correct"
    assert pickle.loads(pickle.dumps(reward)).outcome == "correct"


def test_reward_fn_runs_in_the_reward_process_pool():
    async def main():
        wrapper = AsyncRewardWrapper(arithmetic_reward_fn, timeout_seconds=300, max_workers=1)
        try:
            return await asyncio.gather(
                wrapper("p", "6 * 7 = 42", [1], [2], answer="42"),
                wrapper("p", "6 * 7 = 41", [1], [2], answer="42"),
            )
        finally:
            wrapper.close()

    rewards = asyncio.run(main())
    assert [float(r) for r in rewards] == [1.0, 0.0]
    assert [r.outcome for r in rewards] == ["correct", "incorrect"]
