"""The rollout-workflow contract: one episode from one dataset item."""

from __future__ import annotations

import abc
import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megarl.api.engine_api import GenerationEngine


class RolloutWorkflow(abc.ABC):
    """Turns one dataset item into training trajectories (AReaL's ``RolloutWorkflow``).

    ``arun_episode`` returns a tensor dict in the format of
    :mod:`megarl.api.trajectory` (``[n, seq_len]`` tensors, one row per trajectory)
    or ``None`` to reject the episode: a rejected episode never counts toward a batch.
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: GenerationEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        """Run one episode on ``data`` using ``engine.agenerate``."""


WorkflowLike = RolloutWorkflow | type | str
"""What ``submit`` accepts: an instance, a class (built with ``workflow_kwargs``) or a
``"package.module.Class"`` path; of a workflow or of an agent (:func:`is_agent`)."""


def is_rollout_workflow(obj: Any) -> bool:
    """Whether ``obj`` (a class or an instance) has ``async def arun_episode``: a workflow, whatever its base."""
    return inspect.iscoroutinefunction(getattr(obj, "arun_episode", None))


def is_agent(obj: Any) -> bool:
    """Whether ``obj`` is AReaL's agent-style workflow: ``async def run(self, data, **extra_kwargs)``
    returning a reward, and no ``arun_episode``. It runs behind the OpenAI-compatible proxy
    (:class:`megarl.workflow.openai_agent.OpenAIAgentWorkflow`)."""
    return inspect.iscoroutinefunction(getattr(obj, "run", None)) and not is_rollout_workflow(obj)
