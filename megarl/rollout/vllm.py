"""vLLM: the OpenAI-compatible ``/v1/completions`` dialect and the server launch command.

Verified against vLLM 0.32 (``vllm/entrypoints/openai/completion/protocol.py`` and
``vllm/entrypoints/rl/online/api_router.py``):

* ``prompt`` may be a list of token ids; ``logprobs: 0`` returns the sampled token's
  logprob per position, ``return_token_ids: true`` the generated ids in
  ``choices[0].token_ids`` (``return_tokens_as_token_ids`` also spells tokens as
  ``"token_id:N"``, our fallback).
* With ``VLLM_SERVER_DEV_MODE=1``: ``POST /pause?mode=abort`` ends in-flight requests
  with ``finish_reason: "abort"`` and the tokens so far, and queues new ones;
  ``POST /resume`` lets them run. ``clear_cache`` (default true) drops the prefix cache,
  which new weights make stale.
* ``--logprobs-mode processed_logprobs`` makes logprobs those of the distribution
  actually sampled from (after temperature / top-p / top-k), which is what the PPO
  ratio needs; vLLM's default is the raw model's.
* MoE, with ``--enable-return-routed-experts`` (Model Runner V2, so CUDA only):
  ``routed_experts_prompt_start`` skips that many prompt positions, and
  ``choices[0].routed_experts`` is base64 of a ``.npy`` array ``[positions, layers, top-k]``,
  one row per forwarded position (the last sampled token is not forwarded).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.rollout import VLLM_LORA_RANKS, VLLMConfig
from megarl.rollout.backend import GenerationChunk, HttpCall, InferenceBackend, split_routes
from megarl.rollout.http import MalformedResponseError
from megarl.rollout.server import LaunchSpec
from megarl.utils.auth import api_key, unguarded_env
from megarl.utils.hardware import concrete_dtype

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class VLLMBackend(InferenceBackend):
    """Generation through ``/v1/completions`` with token-id prompts."""

    name = "vllm"
    generate_endpoint = "/v1/completions"
    health_endpoint = "/health"

    def generate_payload(
        self, input_ids: list[int], gconfig: GenerationHyperparameters, max_new_tokens: int, min_new_tokens: int
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "prompt": input_ids,
            "max_tokens": max_new_tokens,
            "min_tokens": min_new_tokens,
            "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
            "top_p": 1.0 if gconfig.greedy else gconfig.top_p,
            "top_k": -1 if gconfig.greedy else gconfig.top_k,
            "min_p": 0.0 if gconfig.greedy else gconfig.min_p,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "stream": False,
        }
        if self.adapter is not None:
            payload["model"] = self.adapter  # a loaded LoRA adapter is served as a model of its own
        if gconfig.stop:
            payload["stop"] = list(gconfig.stop)
        if gconfig.stop_token_ids:
            payload["stop_token_ids"] = list(gconfig.stop_token_ids)
        if gconfig.seed is not None:
            payload["seed"] = gconfig.seed
        if self.return_routed_experts:  # every forwarded position: the input's routes are replayed too
            payload["routed_experts_prompt_start"] = 0
        return payload

    def parse_generate(self, body: Any) -> GenerationChunk:
        try:
            choice = body["choices"][0]
            finish = choice.get("finish_reason")
            logprobs = choice["logprobs"]
            token_logprobs = list(logprobs["token_logprobs"])  # checked by check_chunk: a null is refused
            tokens = choice.get("token_ids")
            token_field = "choices[0].token_ids[{}]"
            if tokens is None:
                tokens = [_token_id(t) for t in logprobs["tokens"]]
                token_field = "choices[0].logprobs.tokens[{}]"
            tokens = list(tokens)
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise MalformedResponseError(
                f"not a /v1/completions reply with logprobs ({type(e).__name__}: {e})"
            ) from None
        if finish not in _FINISH:
            raise MalformedResponseError(f"unknown finish_reason {finish!r}")
        if len(tokens) != len(token_logprobs):
            raise MalformedResponseError(f"{len(tokens)} token ids but {len(token_logprobs)} logprobs")
        prompt_routed, routed = _routed_experts(choice, len(tokens)) if self.return_routed_experts else (None, None)
        return GenerationChunk(
            output_tokens=tokens,
            output_logprobs=token_logprobs,
            finish_reason=_FINISH[finish],
            routed_experts=routed,
            prompt_routed_experts=prompt_routed,
            token_field=token_field,
            logprob_field="choices[0].logprobs.token_logprobs[{}]",
        )

    def pause_calls(self) -> list[HttpCall]:
        return [HttpCall("/pause", params={"mode": "abort"})]

    def resume_calls(self) -> list[HttpCall]:
        return [HttpCall("/resume")]

    def sleep_calls(self) -> list[HttpCall]:
        # level 1: weights to host memory, KV cache dropped (the scheduler pauses first, aborting requests);
        # on CPU the worker keeps its memory and only the scheduler pauses
        return [HttpCall("/sleep", params={"level": "1", "mode": "abort"})]

    def wake_calls(self) -> list[HttpCall]:
        return [HttpCall("/wake_up")]  # every tag: weights and KV cache back, scheduling again


def _routed_experts(choice: dict, n_tokens: int) -> tuple[list[list[int]] | None, list[list[int]]]:
    """``choices[0].routed_experts`` from position 0, as (input tokens, new tokens) (:func:`split_routes`):
    one row ``layers * top-k`` (layer-major) per token. A request aborted before any forward has none."""
    encoded = choice.get("routed_experts")
    if encoded is None:
        if n_tokens == 0:
            return None, []
        raise MalformedResponseError(
            "rollout.return_routed_experts is set but the reply has no choices[0].routed_experts "
            "(is the server started with --enable-return-routed-experts?)"
        )
    prompt = choice.get("prompt_token_ids")
    if not isinstance(prompt, list) or not prompt:
        raise MalformedResponseError("choices[0].prompt_token_ids is missing: routed experts cannot be placed")
    try:
        routes = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, TypeError, OSError) as e:
        raise MalformedResponseError(f"choices[0].routed_experts is not base64 of a .npy array ({e})") from None
    if routes.ndim != 3 or not np.issubdtype(routes.dtype, np.integer):
        raise MalformedResponseError(
            f"choices[0].routed_experts has shape {routes.shape} ({routes.dtype}); expected "
            "[positions, layers, top-k] of integers"
        )
    rows = routes.reshape(routes.shape[0], -1).astype(np.int64).tolist()
    return split_routes(rows, len(prompt), n_tokens, "choices[0].routed_experts")


def _token_id(token: str) -> int:
    prefix, sep, value = str(token).partition("token_id:")
    if not sep or prefix or not value.lstrip("-").isdigit():
        raise MalformedResponseError(f"token {token!r} is not 'token_id:N' (return_tokens_as_token_ids)")
    return int(value)


def _cpu_bind(cpus: Sequence[int], tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` workers over ``cpus``: e.g. ``"0-3|4-7"``."""
    if len(cpus) < tp:
        raise ValueError(f"vLLM on CPU with tp={tp} needs at least {tp} cores, got {list(cpus)}")
    per = len(cpus) // tp
    groups = [cpus[i * per : (i + 1) * per] for i in range(tp)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


# megarl's weight-transfer engine (registered by the ``vllm.general_plugins`` entry point of
# the installed megarl package, see ``megarl.bridge.receivers.vllm``): the trainer's
# ``update_weights`` streams new weights into servers started with it.
WEIGHT_TRANSFER_ARGS = ["--weight-transfer-config", json.dumps({"backend": "megarl"})]


def vllm_launch_spec(
    config: VLLMConfig,
    model_path: str,
    host: str,
    port: int,
    *,
    tp: int = 1,
    devices: Sequence[int] | None = None,
    device_type: str = "cpu",
    replica: int = 0,
    colocated: bool = False,
    lora_rank: int = 0,
    routed_experts: bool = False,
    insecure: bool = False,
) -> LaunchSpec:
    """The command and environment of one vLLM server, guarded by this process's ``$MEGARL_API_KEY``.

    Args:
        config: Server options.
        model_path: HF model directory.
        host, port: Where it listens.
        tp: Tensor-parallel size.
        devices: GPU ids (``device_type="cuda"``) or CPU core ids (``"cpu"``) to run on;
            None lets vLLM choose.
        device_type: ``"cpu"`` (vllm-cpu) or ``"cuda"``.
        replica: Index of this server among its replicas (offsets the seed).
        colocated: It shares its devices with the trainer: on CUDA it starts with sleep mode
            (``/sleep`` frees its memory while the trainer computes); on CPU ``/sleep`` only pauses.
        lora_rank: > 0: it serves the trainer's LoRA adapters of this rank, loaded at run time
            (adapter weight sync): ``--enable-lora``, room for two adapters (the newest version's and
            the previous one's), and the runtime load routes.
        routed_experts: It reports each token's routed experts (``rollout.return_routed_experts``, MoE;
            CUDA only: vLLM's Model Runner V2 returns them, which needs Triton and prefix caching).
        insecure: Without ``$MEGARL_API_KEY``, serve every route to anyone who reaches ``host``
            (``megarl serve --insecure``); without either, a ``ValueError``.
    """
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        concrete_dtype(config.dtype, device_type),
        "--max-model-len",
        str(config.max_model_len),
        "--max-num-seqs",
        str(config.max_num_seqs),
        "--seed",
        str(config.seed + replica),
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if config.block_size is not None:
        if device_type == "cpu" and config.block_size % 32:
            raise ValueError(f"vllm.block_size={config.block_size}: vLLM-CPU needs a multiple of 32")
        cmd += ["--block-size", str(config.block_size)]
    if config.enforce_eager:
        cmd.append("--enforce-eager")
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # /pause, /resume and the weight-update routes
    if device_type == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kvcache_space_gb)
        if devices is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_bind(list(devices), tp)
        elif tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_bind(list(range(tp)), tp)
    elif device_type == "cuda":
        cmd += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
        if colocated:
            cmd.append("--enable-sleep-mode")
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    else:
        raise ValueError(f"vllm_launch_spec: device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if routed_experts:
        if device_type != "cuda" or not config.enable_prefix_caching:
            raise ValueError(
                "rollout.return_routed_experts: vLLM reports routed experts on CUDA with vllm.enable_prefix_caching "
                f"(its Model Runner V2), not on {device_type}"
                + ("" if config.enable_prefix_caching else " with prefix caching off")
            )
        cmd.append("--enable-return-routed-experts")
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if lora_rank > 0:
        cmd += lora_args(lora_rank)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    cmd += ["--middleware", "megarl.utils.auth.RequireApiKey"]  # guards every route but /health (run key)
    env.update(unguarded_env(host, insecure, f"vLLM server {replica}"))
    if api_key():
        env["VLLM_API_KEY"] = api_key()  # vLLM's own check of /v1, from the environment (not on the command line)
    cmd += WEIGHT_TRANSFER_ARGS + list(config.extra_args)
    return LaunchSpec(cmd=cmd, env=env, host=host, port=port, health_endpoint=VLLMBackend.health_endpoint)


def lora_args(rank: int) -> list[str]:
    """vLLM flags serving LoRA adapters of ``rank``: two in a batch (a version's and the one before) and three
    held (a third is loaded before the oldest is dropped)."""
    served = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if served is None:
        raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {rank}")
    return ["--enable-lora", "--max-lora-rank", str(served), "--max-loras", "2", "--max-cpu-loras", "3"]
