"""What a running workflow can learn about its episode (AReaL's ``workflow_context``).

Inside ``arun_episode``::

    from megarl.workflow import workflow_context

    ctx = workflow_context.get()        # is_eval, task_id, version
    scope = workflow_context.stat_scope()   # "rollout" or "eval-rollout"

The pool sets the context per episode; it lives in a ``ContextVar``, so concurrent
episodes on one event loop each see their own.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkflowContext:
    """The episode being run."""

    is_eval: bool = False
    """Evaluation episode (not training data)."""
    task_id: int = -1
    """The pool's id of the episode (-1 outside the pool)."""
    version: int = -1
    """The weights' version when the episode started: the training steps finished by then (-1 outside the pool)."""
    servers: list[str] = field(default_factory=list, compare=False)
    """Addresses of the servers the episode's generations came from (the engine notes them)."""


_OUTSIDE = WorkflowContext()
_CONTEXT: contextvars.ContextVar[WorkflowContext | None] = contextvars.ContextVar(
    "megarl_workflow_context", default=None
)


@dataclass(frozen=True)
class RunLength:
    """How long the training run is, in steps (0: not known, e.g. outside a run)."""

    total_steps: int = 0
    steps_per_epoch: int = 0


_RUN_LENGTH = RunLength()


def set_run_length(total_steps: int, steps_per_epoch: int) -> None:
    """The trainer says how long the run is, once it knows (after loading the dataset)."""
    global _RUN_LENGTH
    _RUN_LENGTH = RunLength(total_steps, steps_per_epoch)


def run_length() -> RunLength:
    """The run's length, as the trainer said (zeros before it did, or outside a run)."""
    return _RUN_LENGTH


def get() -> WorkflowContext:
    """The current episode's context (a default one outside the pool)."""
    return _CONTEXT.get() or _OUTSIDE


def stat_scope() -> str:
    """The stats scope of the current episode: ``"eval-rollout"`` or ``"rollout"``."""
    return "eval-rollout" if get().is_eval else "rollout"


def note_server(address: str) -> None:
    """Note that a generation of the current episode came from ``address`` (nothing outside the pool)."""
    ctx = _CONTEXT.get()
    if ctx is not None and address not in ctx.servers:
        ctx.servers.append(address)


@contextmanager
def use(ctx: WorkflowContext) -> Iterator[WorkflowContext]:
    """Run the block with ``ctx`` as the current context."""
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)
