"""The rollout side: remote inference engine (servers, generation client, rollout pool), staleness.

The server families' dialects, HTTP errors and launching are in :mod:`megarl.serving`; the names this
package exported from there before still import from here until 0.2.0, with a ``DeprecationWarning``.
"""

from megarl.rollout.client import GenerationClient, ServerLostError
from megarl.rollout.engine import RemoteInferenceEngine, RemoteSGLangEngine, RemoteVLLMEngine
from megarl.rollout.pool import RolloutError, RolloutPool
from megarl.rollout.staleness import RolloutStat, StalenessManager
from megarl.utils.deprecation import moved_names

MOVED_TO_SERVING = (
    "GenerationChunk",
    "HttpCall",
    "InferenceBackend",
    "InferenceServer",
    "InferenceServerError",
    "LaunchSpec",
    "MalformedResponseError",
    "NoHealthyServerError",
    "RetryPolicy",
    "SGLangBackend",
    "ServerLaunchError",
    "ServerSet",
    "ServerUnavailableError",
    "VLLMBackend",
    "launch_servers",
    "make_backend",
    "resolve_server_addrs",
    "sglang_launch_spec",
    "vllm_launch_spec",
)
"""Names of :mod:`megarl.serving` this package exported (documented in the name mapping's "A server started
from your own code"): they forward there with a warning until 0.2.0."""

__getattr__ = moved_names(__name__, "megarl.serving", MOVED_TO_SERVING)

__all__ = [
    "GenerationClient",
    "RemoteInferenceEngine",
    "RemoteSGLangEngine",
    "RemoteVLLMEngine",
    "RolloutError",
    "RolloutPool",
    "RolloutStat",
    "ServerLostError",
    "StalenessManager",
]
