"""Run a workflow ``group_size`` times on the same item (GRPO groups)."""

from __future__ import annotations

import asyncio
from typing import Any

from megarl.api.engine_api import GenerationEngine
from megarl.api.trajectory import concat_padded_tensors
from megarl.api.workflow_api import RolloutWorkflow


class GroupedRolloutWorkflow(RolloutWorkflow):
    """Runs ``workflow.arun_episode`` ``group_size`` times concurrently and concatenates.

    Members that return None are dropped; if all do, the group is None (rejected). ``warm_up``
    and ``close`` reach the inner workflow where it has them.
    """

    def __init__(self, workflow: RolloutWorkflow, group_size: int):
        if group_size < 1:
            raise ValueError(f"GroupedRolloutWorkflow: group_size must be >= 1, got {group_size}")
        gconfig = getattr(workflow, "gconfig", None)
        if group_size > 1 and getattr(gconfig, "seed", None) is not None:
            raise ValueError(
                f"GroupedRolloutWorkflow: the inner workflow samples with gconfig.seed={gconfig.seed}, so its "
                f"{group_size} runs on one item would draw identical samples; set gconfig.n_samples for the "
                "group instead, or gconfig.seed=null"
            )
        self.workflow = workflow
        self.group_size = group_size

    async def arun_episode(self, engine: GenerationEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        results = await asyncio.gather(*(self.workflow.arun_episode(engine, data) for _ in range(self.group_size)))
        valid = [r for r in results if r is not None]
        if not valid:
            return None
        return concat_padded_tensors(valid)

    def warm_up(self) -> None:
        """Warm up the inner workflow (e.g. start its reward workers), if it has a ``warm_up``."""
        if hasattr(self.workflow, "warm_up"):
            self.workflow.warm_up()

    def close(self) -> None:
        """Close the inner workflow (e.g. stop its reward workers), if it has a ``close``."""
        if hasattr(self.workflow, "close"):
            self.workflow.close()
