"""The rollout side: remote inference engine (servers, generation client, rollout pool), backends, launch, staleness."""

from megarl.rollout.backend import GenerationChunk, HttpCall, InferenceBackend
from megarl.rollout.client import GenerationClient, ServerLostError
from megarl.rollout.engine import RemoteInferenceEngine, RemoteSGLangEngine, RemoteVLLMEngine, make_backend
from megarl.rollout.http import InferenceServerError, MalformedResponseError, RetryPolicy, ServerUnavailableError
from megarl.rollout.pool import RolloutError, RolloutPool
from megarl.rollout.server import InferenceServer, LaunchSpec, ServerLaunchError, launch_servers, resolve_server_addrs
from megarl.rollout.servers import NoHealthyServerError, ServerSet
from megarl.rollout.sglang import SGLangBackend, sglang_launch_spec
from megarl.rollout.staleness import RolloutStat, StalenessManager
from megarl.rollout.vllm import VLLMBackend, vllm_launch_spec

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
