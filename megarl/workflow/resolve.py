"""Turn what a user passes as a workflow into a :class:`RolloutWorkflow` instance."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from megarl.api.workflow_api import RolloutWorkflow, WorkflowLike
from megarl.workflow.grouped import GroupedRolloutWorkflow


def _import_class(path: str) -> type:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"workflow path {path!r} must look like 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"workflow path {path!r}: cannot import module {module_name!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"workflow path {path!r}: module {module_name!r} has no attribute {attr!r}") from None


def _is_workflow(obj: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(obj, "arun_episode", None))


def resolve_workflow(
    workflow: WorkflowLike, workflow_kwargs: dict[str, Any] | None = None, group_size: int = 1
) -> RolloutWorkflow:
    """An instance from an instance, a class (+ ``workflow_kwargs``) or a ``"module.Class"`` path.

    Any object with an ``async def arun_episode(engine, data)`` counts as a workflow
    (the notebook's plain classes included). ``group_size > 1`` wraps it in a
    :class:`GroupedRolloutWorkflow`.
    """
    if isinstance(workflow, str):
        workflow = _import_class(workflow)
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
