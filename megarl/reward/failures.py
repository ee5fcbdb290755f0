"""A reward function is the user's code: what a failed call does, and when failures stop the run.

A call *fails* when the function raises, runs past its timeout (``reward.timeout_seconds``) or kills its
worker process: it scores 0, is counted (``reward/error``, ``reward/timeout``) and the run goes on, since
a reward may fail now and then on a pathological completion. The function is *broken*, and the run
stops with :class:`RewardFunctionError` naming the function, the exception with its traceback (or the
timeout) and the row of its last failed call, when

* each of the run's first :data:`FIRST_CALLS` calls failed (a function that raises on every call stops
  the run within its first step, before anything is trained on its zeros), or
* more than ``reward.max_error_fraction`` of its last ``reward.error_window`` calls failed.

A value that is not a finite number (None, text, a list, NaN, inf) is a bug in the function, never a
judgement of the completion: the first one stops the run, naming the value and the row.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megarl.api import context as workflow_context
from megarl.reward.base import ScoredReward
from megarl.utils.host_tensors import host_list

logger = logging.getLogger("megarl.reward")

FIRST_CALLS = 8
"""When each of the run's first this many reward calls failed, the function is broken."""
_EXCERPT = 160


class RewardFunctionError(RuntimeError):
    """The reward function is broken (see :mod:`megarl.reward.failures`): the run stops."""


@dataclass(frozen=True)
class RewardFailure:
    """A reward call that produced no reward.

    ``kind``: ``raised`` (``detail``: the traceback), ``timeout``, ``crashed`` (the worker died) or
    ``bad_value`` (``detail``: what it returned).
    """

    kind: Literal["raised", "timeout", "crashed", "bad_value"]
    detail: str = ""


def as_reward(value: Any) -> ScoredReward | RewardFailure:
    """``value`` as a reward, or a ``bad_value`` failure when it is not a finite number.

    A number, a bool (``answer == ref``) or a one-element array counts; text does not, even "1.0".
    """
    if isinstance(value, (str, bytes)) or value is None:
        return RewardFailure("bad_value", _value_text(value))
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
        return RewardFailure("bad_value", _value_text(value))
    if number != number or number in (float("inf"), float("-inf")):
        return RewardFailure("bad_value", _value_text(value))
    if isinstance(value, ScoredReward):
        return ScoredReward(number, value.outcome, value.feedback)
    return ScoredReward(number, "ok")


def _value_text(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def describe_call(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The row a reward call was made on, briefly: the episode's task, the row's fields and the prompt's end."""
    task = workflow_context.get().task_id
    parts = [f"task {task}" if task >= 0 else "a call outside the rollout pool"]
    fields = ", ".join(f"{key}={_short(value)}" for key, value in kwargs.items() if key != "messages")
    if fields:
        parts.append(f"row {{{fields}}}")
    if args and isinstance(args[0], str):
        prompt = args[0].strip()
        parts.append("prompt " + repr(prompt if len(prompt) <= _EXCERPT else "..." + prompt[-_EXCERPT:]))
    if len(args) > 1 and isinstance(args[1], str):
        completion = args[1].strip()
        parts.append("completion " + repr(completion if len(completion) <= _EXCERPT else completion[:_EXCERPT] + "..."))
    return "; ".join(parts)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class RewardFailures:
    """Counts one reward function's failed calls and decides when it is broken.

    Args:
        name: The function's import path (for messages).
        timeout_seconds: Its calls' bound (for messages).
        max_error_fraction: More than this fraction of the last ``error_window`` calls failed: broken.
        error_window: Calls the fraction is measured over.
    """

    def __init__(self, name: str, timeout_seconds: float, max_error_fraction: float = 0.5, error_window: int = 64):
        if not 0 < max_error_fraction <= 1 or error_window < 1:
            raise ValueError(
                f"reward failures: max_error_fraction must be in (0, 1] and error_window >= 1, "
                f"got {max_error_fraction} and {error_window}"
            )
        self.name, self.timeout_seconds = name, timeout_seconds
        self.max_error_fraction, self.error_window = max_error_fraction, error_window
        self._window: collections.deque[bool] = collections.deque(maxlen=error_window)
        self._calls = 0
        self._all_failed = True  # every call so far failed
        self._failed = 0
        self._lock = threading.Lock()

    def record(self, result: ScoredReward | RewardFailure, call: str) -> ScoredReward:
        """The reward of a finished call (0 for a failed one); :class:`RewardFunctionError` when it shows
        the function is broken. ``call``: the row it was made on (:func:`describe_call`)."""
        if isinstance(result, RewardFailure) and result.kind == "bad_value":
            raise RewardFunctionError(
                f"reward function {self.name} returned {result.detail}, not a finite number, on {call}. "
                "A reward must be an int, a float or a bool (a ScoredReward for a counted outcome)"
            )
        failed = isinstance(result, RewardFailure) or result.outcome == "error"
        with self._lock:
            self._calls += 1
            self._window.append(failed)
            self._all_failed = self._all_failed and failed
            self._failed += failed
            calls, failed_total = self._calls, self._failed
            first = min(FIRST_CALLS, self.error_window)
            broken = None
            if failed and self._all_failed and calls == first:
                broken = f"failed on each of its first {first} calls"
            elif failed and calls >= self.error_window:
                n_failed = sum(self._window)
                if n_failed > self.max_error_fraction * self.error_window:
                    broken = (
                        f"failed on {n_failed} of its last {self.error_window} calls (more than "
                        f"reward.max_error_fraction={self.max_error_fraction:g} of reward.error_window)"
                    )
        if not failed:
            return result
        what = self._what(result)
        if broken is not None:
            raise RewardFunctionError(f"reward function {self.name} {broken}; the last, on {call}:\n{what}")
        if failed_total == 1 or failed_total & (failed_total - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... failure
            logger.warning(
                "reward function %s failed (%d of %d calls so far), scoring 0; the last, on %s:\n%s",
                self.name,
                failed_total,
                calls,
                call,
                what,
            )
        return ScoredReward(
            0.0, "timeout" if isinstance(result, RewardFailure) and result.kind == "timeout" else "error"
        )

    def _what(self, result: ScoredReward | RewardFailure) -> str:
        if isinstance(result, ScoredReward):
            return f"it returned {result!r}"
        if result.kind == "timeout":
            return f"it ran past reward.timeout_seconds={self.timeout_seconds:g} s"
        if result.kind == "crashed":
            return f"its worker process died ({result.detail})"
        return result.detail.rstrip()


def check_trajectory_rewards(traj: Any, source: str) -> None:
    """The rewards a trajectory brings to the trainer meet the reward function's check, however they were
    made (a reward function, a workflow's own ``rewards``, an agent's returned or assigned reward through
    the OpenAI-compatible proxy): every one a finite number, else :class:`RewardFunctionError` naming
    ``source``, the row and the value, which stops the run."""
    rewards = traj.get("rewards") if isinstance(traj, Mapping) else None
    if rewards is None:
        return
    if isinstance(rewards, torch.Tensor):
        values = host_list(rewards)  # on the pool's thread: no torch operation (megarl.utils.host_tensors)
    else:
        values = rewards.reshape(-1).tolist() if hasattr(rewards, "reshape") else rewards
    for row, value in enumerate(values if isinstance(values, (list, tuple)) else [values]):
        result = as_reward(value)
        if isinstance(result, RewardFailure):
            raise RewardFunctionError(
                f"{source} gave row {row} of its trajectory the reward {result.detail}, not a finite number; "
                "a reward must be an int, a float or a bool"
            )


def find_reward_error(error: BaseException | None) -> RewardFunctionError | None:
    """The :class:`RewardFunctionError` behind ``error`` (the rollout pool wraps it), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, RewardFunctionError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def reward_failures_note(stats: Mapping[str, float], scope: str = "rollout") -> str | None:
    """For the step's console line: the step's failed reward calls, e.g. ``2 errors, 1 timeout in 16 calls``;
    None when none failed."""
    calls = stats.get(f"{scope}/reward/n_calls", 0.0)
    errors, timeouts = stats.get(f"{scope}/reward/error", 0.0), stats.get(f"{scope}/reward/timeout", 0.0)
    if not (errors or timeouts):
        return None
    counted = [f"{n:.0f} {word}{'s' if n != 1 else ''}" for n, word in ((errors, "error"), (timeouts, "timeout")) if n]
    return f"{', '.join(counted)} in {calls:.0f} calls"
