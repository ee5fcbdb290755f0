"""Arithmetic reward: 1 when the completion's final number equals the integer answer.

The final number is the one inside the last ``\\boxed{...}`` when that box holds a number,
else the last number anywhere in the completion. So ``"7 * 8 = 56"`` and ``"56"`` score 1,
and so does a ramble that happens to end on 56, while ``"7 * 8 = 56, not 54"`` scores 0:
the rule rewards stopping at the answer, the format the prompt asks for.

A number is an optional sign, digits (``1,000`` thousands groups allowed) and optional
decimals; numbers compare exactly (``56.0`` is 56). A minus is a sign only when it is
written against its digits and not a binary minus: ``9-3`` and ``9 - 3`` hold 9 and 3,
``= -3`` holds -3. Unicode minus and dash
characters count as ``-``; number words (``"six"``) do not count.
"""

from __future__ import annotations

import operator
import re
from fractions import Fraction
from typing import Any

from megarl.reward.base import ScoredReward, score_final_answer
from megarl.reward.math_parser import last_boxed

_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\u2014": "-"})
# A sign touches its digits and follows no digit, word or closing bracket ("9-3", "9 - 3": binary).
_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def final_number(text: str) -> Fraction | None:
    """The completion's final number (see the module docstring), or None if it states none."""
    text = text.translate(_MINUS_SIGNS)
    boxed = last_boxed(text)
    numbers = _NUMBER_RE.findall(boxed) if boxed is not None else []
    if not numbers:
        numbers = _NUMBER_RE.findall(text)
    if not numbers:
        return None
    return Fraction(re.sub(r"[,\s]", "", numbers[-1]))


def integer_answer(answer: str) -> Fraction | None:
    """The reference answer as an exact number, or None if it is not one."""
    try:
        return Fraction(answer.strip())
    except ValueError:
        return None


def arithmetic_reward(completion: str, answer: str) -> ScoredReward:
    """1.0 when ``completion``'s final number equals ``answer`` (an integer string), else 0.0.

    Never raises: anything that goes wrong scores 0 with an ``outcome`` saying why.
    """
    return score_final_answer(completion, answer, integer_answer, final_number, operator.eq)


def arithmetic_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> ScoredReward:
    """AReaL's reward signature: ``(prompt, completions, prompt_ids, completion_ids, **data)``.

    ``answer`` is the row's integer answer as a string (``"56"``); the other row columns
    (``messages``, ``a``, ``op``, ``b``) arrive in ``kwargs`` and are ignored.
    """
    return arithmetic_reward(completions, answer)
