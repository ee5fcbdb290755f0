"""Turn what a user passes as a workflow (or filter) into the object the rollout pool runs."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from megarl.api.workflow_api import RolloutWorkflow, WorkflowLike
from megarl.workflow.grouped import GroupedRolloutWorkflow

AcceptFn = Callable[[dict[str, Any]], bool]


def _import_object(path: str, what: str = "workflow") -> Any:
    """The object a ``"package.module.Name"`` path names."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{what} path {path!r} must look like 'package.module.Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} path {path!r}: cannot import module {module_name!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what} path {path!r}: module {module_name!r} has no attribute {attr!r}") from None


def _is_workflow(obj: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(obj, "arun_episode", None))


def _is_agent(obj: Any) -> bool:
    """AReaL's agent-style workflow: ``async def run(data, **extra_kwargs)`` and no ``arun_episode``."""
    return inspect.iscoroutinefunction(getattr(obj, "run", None)) and not _is_workflow(obj)


def _agent_error(obj: Any) -> TypeError:
    name = obj.__qualname__ if isinstance(obj, type) else type(obj).__qualname__
    return TypeError(
        f"{name} is an agent-style workflow (`async def run(self, data, **extra_kwargs)`, AReaL's agent API). "
        "Such an agent makes its LLM calls through an OpenAI-compatible proxy that records token ids and "
        "logprobs for training; megarl has no such proxy yet. Write a RolloutWorkflow instead: a class with "
        "`async def arun_episode(self, engine, data)` that calls `await engine.agenerate(ModelRequest(...))` "
        "and returns `megarl.api.make_trajectory(...)` (or None to reject the episode)"
    )


def resolve_workflow(
    workflow: WorkflowLike, workflow_kwargs: dict[str, Any] | None = None, group_size: int = 1
) -> RolloutWorkflow:
    """An instance from an instance, a class (+ ``workflow_kwargs``) or a ``"module.Class"`` path.

    Any object with an ``async def arun_episode(engine, data)`` counts as a workflow
    (the notebook's plain classes included). ``group_size > 1`` wraps it in a
    :class:`GroupedRolloutWorkflow`. AReaL's agent-style workflows (``async def run``)
    are refused with a :class:`TypeError` saying what to write instead.
    """
    if isinstance(workflow, str):
        workflow = _import_object(workflow)
    if _is_agent(workflow):
        raise _agent_error(workflow)
    if isinstance(workflow, type):
        if not _is_workflow(workflow):
            raise TypeError(f"{workflow.__qualname__} is not a workflow: it has no 'async def arun_episode'")
        instance = workflow(**(workflow_kwargs or {}))
    elif _is_workflow(workflow):
        if workflow_kwargs:
            raise ValueError(
                f"workflow_kwargs {sorted(workflow_kwargs)} given with an already built workflow "
                f"{type(workflow).__qualname__}; pass the class instead"
            )
        instance = workflow
    else:
        raise TypeError(
            f"cannot use {workflow!r} as a workflow: pass a RolloutWorkflow instance, a class, "
            "or a 'package.module.Class' string"
        )
    return GroupedRolloutWorkflow(instance, group_size) if group_size > 1 else instance


def resolve_should_accept_fn(should_accept_fn: AcceptFn | str | None) -> AcceptFn | None:
    """A trajectory filter from a callable, a ``"package.module.function"`` path, or None.

    Anything else fails here rather than inside every episode: most often a
    ``workflow_kwargs`` dict passed positionally in AReaL's argument order.
    """
    if isinstance(should_accept_fn, str):
        should_accept_fn = _import_object(should_accept_fn, "should_accept_fn")
    if should_accept_fn is None or callable(should_accept_fn):
        return should_accept_fn
    hint = ""
    if isinstance(should_accept_fn, dict):
        hint = (
            " (AReaL's positional order is (data, workflow, workflow_kwargs, ...); megarl's third "
            "argument is should_accept_fn: pass workflow_kwargs=... by keyword)"
        )
    raise TypeError(
        "should_accept_fn must be a callable or a 'package.module.function' path, "
        f"got {type(should_accept_fn).__name__}{hint}"
    )
