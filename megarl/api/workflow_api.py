"""The rollout-workflow contract: one episode from one dataset item."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megarl.api.engine_api import InferenceEngine


class RolloutWorkflow(abc.ABC):
    """Turns one dataset item into training trajectories (AReaL's ``RolloutWorkflow``).

    ``arun_episode`` returns a tensor dict in the format of
    :mod:`megarl.api.trajectory` (``[n, seq_len]`` tensors, one row per trajectory)
    or ``None`` to reject the episode: a rejected episode never counts toward a batch.
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        """Run one episode on ``data`` using ``engine.agenerate``."""


WorkflowLike = RolloutWorkflow | type | str
"""What ``submit`` accepts: an instance, a class (built with ``workflow_kwargs``) or a
``"package.module.Class"`` path."""
