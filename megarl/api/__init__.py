"""Contracts only: the inference-engine and workflow ABCs, requests/responses, the trajectory format."""

from megarl.api.engine_api import GenerationEngine, InferenceEngine
from megarl.api.io_struct import ModelRequest, ModelResponse, StopReason
from megarl.api.trajectory import build_trajectory, concat_padded_tensors, make_trajectory, oldest_version
from megarl.api.workflow_api import RolloutWorkflow, WorkflowLike

__all__ = [
    "GenerationEngine",
    "InferenceEngine",
    "ModelRequest",
    "ModelResponse",
    "RolloutWorkflow",
    "StopReason",
    "WorkflowLike",
    "build_trajectory",
    "concat_padded_tensors",
    "make_trajectory",
    "oldest_version",
]
