"""What a running workflow can learn about its episode (AReaL's ``workflow_context``).

Inside ``arun_episode``::

    from megarl.workflow import workflow_context

    ctx = workflow_context.get()        # is_eval, task_id
    scope = workflow_context.stat_scope()   # "rollout" or "eval-rollout"

The pool sets the context per episode; it lives in a ``ContextVar``, so concurrent
episodes on one event loop each see their own.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkflowContext:
    """The episode being run."""

    is_eval: bool = False
    """Evaluation episode (not training data)."""
    task_id: int = -1
    """The pool's id of the episode (-1 outside the pool)."""


_OUTSIDE = WorkflowContext()
_CONTEXT: contextvars.ContextVar[WorkflowContext | None] = contextvars.ContextVar(
    "megarl_workflow_context", default=None
)


def get() -> WorkflowContext:
    """The current episode's context (a default one outside the pool)."""
    return _CONTEXT.get() or _OUTSIDE


def stat_scope() -> str:
    """The stats scope of the current episode: ``"eval-rollout"`` or ``"rollout"``."""
    return "eval-rollout" if get().is_eval else "rollout"


@contextmanager
def use(ctx: WorkflowContext) -> Iterator[WorkflowContext]:
    """Run the block with ``ctx`` as the current context."""
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)
