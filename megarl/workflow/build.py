"""Build the trainer's workflows from the config (``workflow``, ``eval_workflow``)."""

from __future__ import annotations

from typing import Any

from megarl.api.workflow_api import RolloutWorkflow, is_agent
from megarl.config.rollout import WorkflowConfig
from megarl.utils.plugins import accepted_parameters, import_plugin
from megarl.workflow.openai_agent import OpenAIAgentWorkflow, trainer_export_problem
from megarl.workflow.resolve import resolve_workflow


def build_workflow(config: WorkflowConfig, run: dict[str, Any], key: str = "workflow") -> RolloutWorkflow:
    """``config``'s class built with its ``kwargs`` and those of ``run`` its constructor takes.

    ``run`` holds the run's objects by :data:`~megarl.config.rollout.RUN_ARGUMENTS` name; a
    ``reward_fn`` given in ``kwargs`` as an import path is imported. An agent class (AReaL's
    ``async def run(data, **extra_kwargs)``) is built the same way and runs behind the
    OpenAI-compatible proxy, sampled with the run's ``gconfig``, its tokenizer's chat template
    and its context length.
    """
    cls = import_plugin(config.class_path, f"{key}.type")
    kwargs = dict(config.kwargs)
    if isinstance(kwargs.get("reward_fn"), str):
        kwargs["reward_fn"] = import_plugin(kwargs["reward_fn"], f"{key}.kwargs.reward_fn")
    accepted = accepted_parameters(cls)
    for name, value in run.items():
        if accepted is not None and name in accepted and name not in kwargs:
            kwargs[name] = value
    if is_agent(cls):
        agent = OpenAIAgentWorkflow(cls(**kwargs), run.get("gconfig"), run.get("tokenizer"), run.get("max_context_len"))
        return resolve_workflow(agent, None, config.group_size)
    workflow = resolve_workflow(cls, kwargs, config.group_size)
    inner = getattr(workflow, "workflow", workflow)  # a GroupedRolloutWorkflow runs it group_size times
    problem = trainer_export_problem(inner.export_style) if isinstance(inner, OpenAIAgentWorkflow) else None
    if problem is not None:  # set where the config check cannot see it (e.g. in the class's __init__)
        raise ValueError(f"{key}.type={config.type!r}: {problem}")
    return workflow


def build_eval_workflow(
    config: WorkflowConfig | None, train_config: WorkflowConfig, train_workflow: RolloutWorkflow, run: dict[str, Any]
) -> RolloutWorkflow:
    """The evaluation workflow: ``config``, else the training one sampling as ``run["gconfig"]`` does.

    A training workflow with ``with_gconfig`` (the built-ins, agents) shares its reward workers
    (or proxy) with the evaluation twin; another is built again, once per prompt (``group_size`` 1).
    """
    if config is not None:
        return build_workflow(config, run, "eval_workflow")
    if hasattr(train_workflow, "with_gconfig") and train_config.group_size == 1:
        return train_workflow.with_gconfig(run["gconfig"])
    return build_workflow(WorkflowConfig(train_config.type, dict(train_config.kwargs)), run)
