"""What a config names by import path (a user's workflow, reward or loss): imported and checked.

Every plug-in key of the config (``workflow.type``, ``reward_fn``, ``actor.loss``) goes
through :func:`import_plugin` when the config is checked, before anything is launched, and
its call signature through :func:`signature_problem`: a typo or a wrong signature fails in
seconds with the key named, not after the servers came up.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from megarl.config.base import ConfigError


def import_plugin(path: str, key: str) -> Any:
    """``package.module.name`` → the object; a :class:`ConfigError` naming ``key`` otherwise."""
    module_name, _, name = path.rpartition(".")
    if not module_name or not name:
        raise ConfigError(key, f"{path!r} is not of the form 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(key, f"{path!r}: cannot import module {module_name!r}: {err}") from None
    except Exception as err:  # the user's module itself raised while importing
        raise ConfigError(key, f"{path!r}: importing {module_name!r} raised {type(err).__name__}: {err}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(key, f"{path!r}: module {module_name!r} has no attribute {name!r}") from None


def signature_problem(fn: Any, args: tuple = (), kwargs: dict | None = None, partial: bool = False) -> str | None:
    """Why calling ``fn(*args, **kwargs)`` would fail on the signature alone, else None.

    ``partial``: more arguments come at call time (a reward's dataset fields), so only
    those given are checked.
    """
    if not callable(fn):
        return f"{fn!r} is not callable"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature (a C function): trust it
        return None
    try:
        (signature.bind_partial if partial else signature.bind)(*args, **(kwargs or {}))
    except TypeError as err:
        return f"{getattr(fn, '__qualname__', fn)}{signature} cannot be called that way: {err}"
    return None


def accepted_parameters(fn: Any) -> set[str] | None:
    """Names ``fn`` takes as keywords; None when it takes any (``**kwargs``)."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in keyword}


def workflow_problem(class_path: str, kwargs: dict[str, Any], key: str) -> str | None:
    """Why ``class_path`` built with ``kwargs`` (and the run's arguments) is neither a workflow nor an
    agent (which runs behind the OpenAI-compatible proxy), else None."""
    from megarl.api.workflow_api import is_agent, is_rollout_workflow
    from megarl.config.rollout import RUN_ARGUMENTS

    cls = import_plugin(class_path, key)
    if not inspect.isclass(cls):
        return f"{class_path!r} is not a class"
    if not (is_rollout_workflow(cls) or is_agent(cls)):
        return (f"{cls.__qualname__} has no 'async def arun_episode(self, engine, data)' (see RolloutWorkflow), "
                "nor an agent's 'async def run(self, data, **extra_kwargs)' (see megarl.workflow.openai_agent)")  # fmt: skip
    accepted = accepted_parameters(cls)
    if accepted is not None:
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            return f"{cls.__qualname__} takes no argument(s) {unknown}; it takes {sorted(accepted)}"
    run = {name: None for name in RUN_ARGUMENTS if accepted is not None and name in accepted and name not in kwargs}
    return signature_problem(cls, (), {**run, **kwargs})
