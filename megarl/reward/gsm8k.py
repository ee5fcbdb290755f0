"""GSM8K / math reward: 1 when the completion's final answer equals the reference's."""

from __future__ import annotations

from functools import partial
from typing import Any

from megarl.reward.base import ScoredReward, score_final_answer
from megarl.reward.math_parser import extract_answer, math_equal


def math_reward(completion: str, answer: str, timeout_seconds: int | None = 5) -> ScoredReward:
    """Score ``completion`` against the reference ``answer`` (a GSM8K solution or a bare answer).

    Never raises: anything that goes wrong scores 0 with an ``outcome`` saying why.
    """
    return score_final_answer(
        completion, answer, extract_answer, extract_answer, partial(math_equal, timeout_seconds=timeout_seconds)
    )


def gsm8k_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> ScoredReward:
    """AReaL's reward signature: ``(prompt, completions, prompt_ids, completion_ids, **data)``.

    ``answer`` is the dataset row's reference solution (``"... #### 72"``).
    """
    return math_reward(completions, answer)
