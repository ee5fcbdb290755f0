"""GSM8K / math reward: 1 when the completion's final answer equals the reference's."""

from __future__ import annotations

import logging
from typing import Any

from megarl.reward.base import ScoredReward
from megarl.reward.math_parser import extract_answer, math_equal

logger = logging.getLogger(__name__)


def math_reward(completion: str, answer: str, timeout_seconds: int | None = 5) -> ScoredReward:
    """Score ``completion`` against the reference ``answer`` (a GSM8K solution or a bare answer).

    Never raises: anything that goes wrong scores 0 with an ``outcome`` saying why.
    """
    try:
        ref = extract_answer(str(answer))
        if ref is None:
            return ScoredReward(0.0, "bad_reference")
        pred = extract_answer(completion)
        if pred is None:
            return ScoredReward(0.0, "no_answer")
        ok = math_equal(pred, ref, timeout_seconds=timeout_seconds)
        return ScoredReward(1.0 if ok else 0.0, "correct" if ok else "incorrect")
    except Exception as e:  # noqa: BLE001 -- a reward must never take the rollout down
        logger.debug("math reward failed on %r vs %r: %r", completion[-200:], answer, e)
        return ScoredReward(0.0, "error")


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
