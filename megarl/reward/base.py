"""What a reward function returns."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Self

logger = logging.getLogger(__name__)

OUTCOMES = ("correct", "incorrect", "no_answer", "bad_reference", "error", "timeout")
"""How a math reward was decided: the first two are judgements; ``no_answer`` (the
completion states no parsable answer), ``bad_reference`` (the reference has none),
``error`` (the reward function raised) and ``timeout`` count as parse failures and
score 0."""


class ScoredReward(float):
    """A reward (it *is* a float) that also records how it was decided in ``outcome``.

    Reward functions may return a plain float; returning a ``ScoredReward`` lets the
    rollout side count parse failures in its stats without a second channel.
    """

    outcome: str
    feedback: str
    """What the reward can tell the model about its answer ("" when nothing): a failing test's error, say.
    A multi-turn workflow's reflection prompt may quote it (:mod:`megarl.workflow.multi_turn`)."""

    def __new__(cls, value: float, outcome: str, feedback: str = "") -> Self:
        obj = super().__new__(cls, value)
        obj.outcome, obj.feedback = outcome, feedback
        return obj

    def __reduce__(self):
        # Rewards cross process boundaries (process pool): keep the outcome and feedback.
        return (ScoredReward, (float(self), self.outcome, self.feedback))

    def __repr__(self) -> str:
        feedback = f", {self.feedback!r}" if self.feedback else ""
        return f"ScoredReward({float(self)!r}, {self.outcome!r}{feedback})"


def score_final_answer(
    completion: str,
    answer: str,
    parse_reference: Callable[[str], Any],
    parse_completion: Callable[[str], Any],
    equal: Callable[[Any, Any], bool],
) -> ScoredReward:
    """1.0 when the completion's parsed answer ``equal``s the reference's, else 0.0.

    The scaffold every answer-checking reward shares: a reference that parses to None is
    ``bad_reference``, a completion that parses to None is ``no_answer``, and anything that
    raises scores 0 as ``error`` (a reward must never take the rollout down).
    """
    try:
        ref = parse_reference(str(answer))
        if ref is None:
            return ScoredReward(0.0, "bad_reference")
        pred = parse_completion(completion)
        if pred is None:
            return ScoredReward(0.0, "no_answer")
        ok = equal(pred, ref)
        return ScoredReward(1.0 if ok else 0.0, "correct" if ok else "incorrect")
    except Exception as e:  # noqa: BLE001
        logger.debug("reward failed on %r vs %r: %r", completion[-200:], answer, e)
        return ScoredReward(0.0, "error")


def no_reward_fn(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **row: Any) -> float:
    """0 for every completion: pure on-policy distillation, whose whole signal is the teacher's (a ``teacher``
    block); rows need no answer. Evaluate with a real reward (``eval_workflow``'s ``reward_fn``)."""
    return 0.0
