"""Rollout workflows: RLVR, multi-turn reflection, grouped, agents on the OpenAI-compatible proxy;
resolution, context and dumping."""

from megarl.api import context as workflow_context
from megarl.workflow.dump import TrajectoryDumper
from megarl.workflow.grouped import GroupedRolloutWorkflow
from megarl.workflow.multi_turn import MultiTurnReflectionWorkflow, reflection_token_ids
from megarl.workflow.openai_agent import OpenAIAgentWorkflow
from megarl.workflow.resolve import resolve_workflow
from megarl.workflow.rlvr import RLVRWorkflow, default_data_extract_prompt_fn, default_get_input_ids_fn

__all__ = [
    "GroupedRolloutWorkflow",
    "MultiTurnReflectionWorkflow",
    "OpenAIAgentWorkflow",
    "RLVRWorkflow",
    "TrajectoryDumper",
    "default_data_extract_prompt_fn",
    "default_get_input_ids_fn",
    "reflection_token_ids",
    "resolve_workflow",
    "workflow_context",
]
