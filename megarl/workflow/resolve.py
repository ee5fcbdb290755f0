"""Turn what a user passes as a workflow (or filter) into the object the rollout pool runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megarl.api.workflow_api import RolloutWorkflow, WorkflowLike, is_agent, is_rollout_workflow
from megarl.utils.plugins import FORMS, import_plugin
from megarl.workflow.grouped import GroupedRolloutWorkflow
from megarl.workflow.openai_agent import OpenAIAgentWorkflow

AcceptFn = Callable[[dict[str, Any]], bool]


def _instantiate(obj: Any, kwargs: dict[str, Any] | None) -> Any:
    """``obj`` built with ``kwargs`` when it is a class, else ``obj`` itself (which takes none)."""
    if isinstance(obj, type):
        return obj(**(kwargs or {}))
    if kwargs:
        raise ValueError(
            f"workflow_kwargs {sorted(kwargs)} given with an already built "
            f"{type(obj).__qualname__}; pass the class instead"
        )
    return obj


def resolve_workflow(
    workflow: WorkflowLike, workflow_kwargs: dict[str, Any] | None = None, group_size: int = 1
) -> RolloutWorkflow:
    """An instance from an instance, a class (+ ``workflow_kwargs``) or a path to one
    (``"package.module.Class"`` or ``"path/to/file.py:Class"``, :mod:`megarl.utils.plugins`).

    Any object with an ``async def arun_episode(engine, data)`` counts as a workflow (the
    notebook's plain classes included). AReaL's agent-style workflows (``async def run(data,
    **extra_kwargs)``, :func:`~megarl.api.workflow_api.is_agent`) run behind the
    OpenAI-compatible proxy, with :class:`OpenAIAgentWorkflow`'s default sampling (one run per
    episode: ``group_size`` makes the group, as in AReaL) and the engine's tokenizer; a
    config's ``workflow.type`` passes the run's instead (:func:`megarl.workflow.build.build_workflow`).
    ``group_size > 1`` wraps the result in a :class:`GroupedRolloutWorkflow`.
    """
    if isinstance(workflow, str):
        workflow = import_plugin(workflow, "workflow")
    agent = is_agent(workflow)
    if not (agent or is_rollout_workflow(workflow)):
        if isinstance(workflow, type):
            raise TypeError(
                f"{workflow.__qualname__} is not a workflow: it has no 'async def arun_episode' "
                "(nor an agent's 'async def run(self, data, **extra_kwargs)')"
            )
        raise TypeError(
            f"cannot use {workflow!r} as a workflow: pass a RolloutWorkflow or an agent (an "
            f"instance or a class), or a path to one: {FORMS}"
        )
    instance = _instantiate(workflow, workflow_kwargs)
    if agent:
        instance = OpenAIAgentWorkflow(instance)
    return GroupedRolloutWorkflow(instance, group_size) if group_size > 1 else instance


def resolve_should_accept_fn(should_accept_fn: AcceptFn | str | None) -> AcceptFn | None:
    """A trajectory filter from a callable, a path to one (``"package.module.function"`` or
    ``"path/to/file.py:function"``), or None.

    Anything else fails here rather than inside every episode: most often a
    ``workflow_kwargs`` dict passed positionally in AReaL's argument order.
    """
    if isinstance(should_accept_fn, str):
        should_accept_fn = import_plugin(should_accept_fn, "should_accept_fn")
    if should_accept_fn is None or callable(should_accept_fn):
        return should_accept_fn
    hint = ""
    if isinstance(should_accept_fn, dict):
        hint = (
            " (AReaL's positional order is (data, workflow, workflow_kwargs, ...); megarl's third "
            "argument is should_accept_fn: pass workflow_kwargs=... by keyword)"
        )
    raise TypeError(
        f"should_accept_fn must be a callable or a path to one ({FORMS}), got {type(should_accept_fn).__name__}{hint}"
    )
