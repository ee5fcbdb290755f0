"""What a reward call knows of the run, and the numbers it logs, inside the worker process that runs it.

Rewards run in worker processes (:mod:`megarl.reward.executor`): the caller sends each call the run's
:class:`TrainerState` as it stands for the episode, and the worker sends back, with the reward, what
the call logged with :func:`log_metric` (and the numeric values of :func:`log_extra`). The caller
records them in ``stats_tracker`` under :data:`LOGGED_PREFIX` (``rollout/reward/logged/<name>`` in
the step's stats), each name the mean of the values logged during the step.
"""

from __future__ import annotations

import contextvars
import numbers
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from megarl.api import context as workflow_context

LOGGED_PREFIX = "reward/logged/"
"""Stats key prefix of the numbers a reward logs (in the episode's scope: ``rollout/reward/logged/<name>``)."""


@dataclass(frozen=True)
class TrainerState:
    """The run's progress as a reward sees it: the attributes of TRL's ``trainer_state`` that rewards read.

    ``global_step``: the training steps finished when the episode started (the weights' version its
    completions came from; 0 outside a run). ``max_steps``: the run's steps (0 when not known: outside a
    run). ``epoch``: ``global_step`` in epochs, a fraction as in TRL (None when not known).
    """

    global_step: int = 0
    max_steps: int = 0
    epoch: float | None = None


def episode_trainer_state() -> TrainerState:
    """The :class:`TrainerState` of the episode being run (the caller's side of a reward call)."""
    step = max(workflow_context.get().version, 0)
    length = workflow_context.run_length()
    epoch = step / length.steps_per_epoch if length.steps_per_epoch else None
    return TrainerState(global_step=step, max_steps=length.total_steps, epoch=epoch)


@dataclass
class RewardCall:
    """One reward call: the run's state it was made at, and the numbers it logged by name."""

    trainer_state: TrainerState = field(default_factory=TrainerState)
    logged: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))


_CURRENT: contextvars.ContextVar[RewardCall] = contextvars.ContextVar("megarl_reward_call", default=RewardCall())
"""The reward call running now: a context variable, so that the ``async def`` rewards awaited side by side
on one event loop (each in its own task) each log into their own call."""


@contextmanager
def reward_call(trainer_state: TrainerState) -> Iterator[RewardCall]:
    """Run a reward call at ``trainer_state`` (in a worker, or in a task of the rollout's loop), collecting
    what it logs."""
    call = RewardCall(trainer_state)
    token = _CURRENT.set(call)
    try:
        yield call
    finally:
        _CURRENT.reset(token)


def current_trainer_state() -> TrainerState:
    """The run's state for the reward call running now."""
    return _CURRENT.get().trainer_state


def log_metric(name: str, value: float) -> None:
    """Log a number from a reward (TRL's ``log_metric``): the step's stats show the mean of its values."""
    _CURRENT.get().logged[name].append(float(value))


def log_extra(column: str, values: list) -> None:
    """TRL's ``log_extra`` (a column of its completions table): megarl keeps no such table, so the column's
    numbers (bools count) are logged as :func:`log_metric` does; text and other values are not kept."""
    for value in values:
        if isinstance(value, numbers.Real):
            log_metric(column, value)
