"""The rollout side: remote inference engine (servers, generation client, rollout pool), backends, launch, staleness."""

from megarl.rollout.client import GenerationClient, ServerLostError
from megarl.rollout.engine import RemoteInferenceEngine, RemoteSGLangEngine, RemoteVLLMEngine, make_backend
from megarl.rollout.pool import RolloutError, RolloutPool
from megarl.rollout.staleness import RolloutStat, StalenessManager
from megarl.serving.backend import GenerationChunk, HttpCall, InferenceBackend
from megarl.serving.http import InferenceServerError, MalformedResponseError, RetryPolicy, ServerUnavailableError
from megarl.serving.launch import InferenceServer, LaunchSpec, ServerLaunchError, launch_servers, resolve_server_addrs
from megarl.serving.servers import NoHealthyServerError, ServerSet
from megarl.serving.sglang import SGLangBackend, sglang_launch_spec
from megarl.serving.vllm import VLLMBackend, vllm_launch_spec

__all__ = [
    "GenerationChunk",
    "GenerationClient",
    "HttpCall",
    "InferenceBackend",
    "InferenceServer",
    "InferenceServerError",
    "LaunchSpec",
    "MalformedResponseError",
    "NoHealthyServerError",
    "RemoteInferenceEngine",
    "RemoteSGLangEngine",
    "RemoteVLLMEngine",
    "RetryPolicy",
    "RolloutError",
    "RolloutPool",
    "RolloutStat",
    "SGLangBackend",
    "ServerLaunchError",
    "ServerLostError",
    "ServerSet",
    "ServerUnavailableError",
    "StalenessManager",
    "VLLMBackend",
    "launch_servers",
    "make_backend",
    "resolve_server_addrs",
    "sglang_launch_spec",
    "vllm_launch_spec",
]
