"""The inference servers: what megarl says to each backend, and the one owner of the servers of a run.

One file per backend holds every HTTP call megarl makes to that server family
(:mod:`~megarl.serving.vllm`, :mod:`~megarl.serving.sglang`): the generation dialect the rollout
side speaks (:class:`~megarl.serving.backend.InferenceBackend`), the trainer's control calls
(:class:`~megarl.serving.control.ServerControl`: weight updates, LoRA adapters, probe scoring) and
the launch command. Beside them:

- ``http``: the HTTP plumbing both sides use (the rollout side's async requests, the trainer's blocking
  calls), its retries and errors;
- ``servers``: :class:`~megarl.serving.servers.ServerSet`, the one owner of the run's servers (routing,
  health, restart, join, leave, readmission), which the rollout side routes with and the weight-sync
  phase asks whom to update;
- ``launch``: starting servers and waiting for them; ``restarts``: the launcher's restart and join records.
- ``vllm_compile_cache``: a compiled vLLM-CPU server loads its model back from vLLM's compile cache
  (installed in the server by the vLLM plugin).

The in-server half of the weight transfer (the vLLM plugin) runs inside the server and lives with the
bridge it receives from (:mod:`megarl.bridge.receivers.vllm`).
"""

from megarl.serving.backend import GenerationChunk, HttpCall, InferenceBackend
from megarl.serving.control import ServerControl, ServerRef
from megarl.serving.families import make_backend, make_control, server_ref
from megarl.serving.http import (
    InferenceServerError,
    MalformedResponseError,
    RetryPolicy,
    ServerControlError,
    ServerUnavailableError,
    http_json,
)
from megarl.serving.launch import InferenceServer, LaunchSpec, ServerLaunchError, launch_servers, resolve_server_addrs
from megarl.serving.servers import NoHealthyServerError, ServerSet
from megarl.serving.sglang import SGLangBackend, SGLangControl, sglang_launch_spec
from megarl.serving.vllm import VLLMBackend, VLLMControl, vllm_launch_spec

__all__ = [
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
    "SGLangControl",
    "ServerControl",
    "ServerControlError",
    "ServerLaunchError",
    "ServerRef",
    "ServerSet",
    "ServerUnavailableError",
    "VLLMBackend",
    "VLLMControl",
    "http_json",
    "launch_servers",
    "make_backend",
    "make_control",
    "resolve_server_addrs",
    "server_ref",
    "sglang_launch_spec",
    "vllm_launch_spec",
]
