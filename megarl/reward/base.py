"""What a reward function returns."""

from __future__ import annotations

from typing import Self

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

    def __new__(cls, value: float, outcome: str) -> Self:
        obj = super().__new__(cls, value)
        obj.outcome = outcome
        return obj

    def __reduce__(self):
        # Rewards cross process boundaries (process pool): keep the outcome.
        return (ScoredReward, (float(self), self.outcome))

    def __repr__(self) -> str:
        return f"ScoredReward({float(self)!r}, {self.outcome!r})"
