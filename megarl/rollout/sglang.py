"""SGLang: the native ``/generate`` dialect and the server launch command.

Payloads follow SGLang 0.5's own request schema (``sglang.api.v1.api_types``:
``GenerateRequest`` / ``SamplingParams`` / ``GenerateResponse``; the tests validate
them there). ``/pause_generation`` with ``mode: "abort"`` ends in-flight requests with
``meta_info.finish_reason.type == "abort"`` and the tokens so far;
``/continue_generation`` resumes; ``/flush_cache`` drops the radix cache that new
weights make stale (it only works while nothing runs, i.e. while paused).
"""

from __future__ import annotations

import base64
import binascii
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.rollout import SGLangConfig
from megarl.rollout.backend import GenerationChunk, HttpCall, InferenceBackend, split_routes
from megarl.rollout.http import MalformedResponseError
from megarl.rollout.server import LaunchSpec
from megarl.utils.auth import api_key, unguarded_env
from megarl.utils.hardware import concrete_dtype

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangBackend(InferenceBackend):
    """Generation through SGLang's ``/generate`` with ``input_ids``."""

    name = "sglang"
    generate_endpoint = "/generate"
    health_endpoint = "/health"

    def generate_payload(
        self, input_ids: list[int], gconfig: GenerationHyperparameters, max_new_tokens: int, min_new_tokens: int
    ) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": min_new_tokens,
            "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
            "top_p": 1.0 if gconfig.greedy else gconfig.top_p,
            "skip_special_tokens": False,
        }
        if not gconfig.greedy and gconfig.top_k > 0:
            sampling["top_k"] = gconfig.top_k
        if gconfig.greedy:
            sampling["top_k"] = 1
        if not gconfig.greedy and gconfig.min_p > 0:
            sampling["min_p"] = gconfig.min_p
        if gconfig.stop:
            sampling["stop"] = list(gconfig.stop)
        if gconfig.stop_token_ids:
            sampling["stop_token_ids"] = list(gconfig.stop_token_ids)
        if gconfig.seed is not None:
            sampling["sampling_seed"] = gconfig.seed
        payload = {
            "input_ids": input_ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "stream": False,
        }
        if self.adapter is not None:
            payload["lora_path"] = self.adapter  # a loaded adapter's name (GenerateReqInput.lora_path)
        if self.return_routed_experts:  # every forwarded position: the input's routes are replayed too
            payload.update(return_routed_experts=True, routed_experts_start_len=0)
        return payload

    def parse_generate(self, body: Any) -> GenerationChunk:
        try:
            meta = body["meta_info"]
            finish = meta["finish_reason"]
            finish_type = finish["type"] if isinstance(finish, dict) else finish
            entries = meta["output_token_logprobs"] or []
            logprobs = [e[0] for e in entries]  # checked by check_chunk: a null is refused
            tokens = [e[1] for e in entries]
        except (KeyError, IndexError, TypeError) as e:
            raise MalformedResponseError(f"not a /generate reply with logprobs ({type(e).__name__}: {e})") from None
        output_ids = body.get("output_ids")
        if output_ids is not None and list(output_ids) != tokens:
            raise MalformedResponseError("output_ids disagree with output_token_logprobs")
        if finish_type not in _FINISH:
            raise MalformedResponseError(f"unknown finish_reason {finish!r}")
        prompt_routed, routed = _routed_experts(meta, len(tokens)) if self.return_routed_experts else (None, None)
        return GenerationChunk(
            tokens,
            logprobs,
            _FINISH[finish_type],
            routed,
            prompt_routed,
            token_field="meta_info.output_token_logprobs[{}][1]",
            logprob_field="meta_info.output_token_logprobs[{}][0]",
        )

    def pause_calls(self) -> list[HttpCall]:
        return [HttpCall("/pause_generation", payload={"mode": "abort"})]

    def resume_calls(self) -> list[HttpCall]:
        return [HttpCall("/flush_cache"), HttpCall("/continue_generation", payload={})]

    def sleep_calls(self) -> list[HttpCall]:
        # needs --enable-memory-saver (sglang_launch_spec adds it for a colocated allocation)
        return [*self.pause_calls(), HttpCall("/release_memory_occupation", payload={})]

    def wake_calls(self) -> list[HttpCall]:
        return [HttpCall("/resume_memory_occupation", payload={})]


def _routed_experts(meta: dict, n_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """``meta_info.routed_experts``: base64 of int32 ``[positions, layers, top-k]`` (SGLang's
    ``extract_routed_experts_from_meta_info``) from position 0, as (input tokens, new tokens) (:func:`split_routes`)."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise MalformedResponseError(
            "rollout.return_routed_experts is set but the reply has no meta_info.routed_experts "
            "(is the server started with --enable-return-routed-experts?)"
        )
    n_input = meta.get("prompt_tokens")
    if type(n_input) is not int or n_input < 1:
        raise MalformedResponseError(f"meta_info.prompt_tokens is {n_input!r:.40}, not a count of input tokens")
    try:
        flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError, TypeError) as e:
        raise MalformedResponseError(f"meta_info.routed_experts is not base64 of int32 ({e})") from None
    positions = n_input - 1 + n_tokens
    if positions == 0:
        return [], []
    if flat.size == 0 or flat.size % positions:
        raise MalformedResponseError(
            f"meta_info.routed_experts holds {flat.size} ids for {positions} positions "
            f"({n_input} input tokens and {n_tokens} new tokens, less the last)"
        )
    return split_routes(flat.reshape(positions, -1).tolist(), n_input, n_tokens, "meta_info.routed_experts")


def sglang_launch_spec(
    config: SGLangConfig,
    model_path: str,
    host: str,
    port: int,
    *,
    tp: int = 1,
    devices: Sequence[int] | None = None,
    replica: int = 0,
    routed_experts: bool = False,
    colocated: bool = False,
    lora_rank: int = 0,
    insecure: bool = False,
) -> LaunchSpec:
    """The command and environment of one SGLang server on GPUs ``devices`` (CUDA only); ``colocated``:
    it shares them with the trainer and releases its memory while the trainer computes; ``lora_rank`` > 0:
    it serves the trainer's LoRA adapters of that rank, loaded at run time (adapter weight sync).

    It is guarded by this process's ``$MEGARL_API_KEY``; without one, ``insecure`` must say that it serves
    every route (its weight-update routes included) to anyone who reaches ``host``, else a ``ValueError``."""
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp),
        "--dtype",
        concrete_dtype(config.dtype, "cuda"),
        "--context-length",
        str(config.context_length),
        "--mem-fraction-static",
        str(config.mem_fraction_static),
        "--random-seed",
        str(config.random_seed + replica),
        "--skip-server-warmup",
    ]
    if config.attention_backend:
        cmd += ["--attention-backend", config.attention_backend]
    if config.disable_cuda_graph:
        cmd.append("--disable-cuda-graph")
    if config.enable_metrics:
        cmd.append("--enable-metrics")
    if routed_experts:  # rollout.return_routed_experts
        cmd.append("--enable-return-routed-experts")
    if colocated:  # /release_memory_occupation and /resume_memory_occupation (torch_memory_saver)
        cmd.append("--enable-memory-saver")
    if lora_rank > 0:  # every linear may carry an adapter; the newest two versions (and base) in a batch
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--lora-target-modules", "all"]
        cmd += ["--max-loras-per-batch", "3", "--max-loaded-loras", "3"]
    env = unguarded_env(host, insecure, f"SGLang server {replica}")
    if api_key():
        cmd += ["--api-key", api_key()]  # all but /health*, /ready*, /metrics (no env variable)
    if devices is not None:
        if len(devices) != tp:
            raise ValueError(f"sglang_launch_spec: tp={tp} needs {tp} devices, got {list(devices)}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    cmd += list(config.extra_args)
    return LaunchSpec(cmd=cmd, env=env, host=host, port=port, health_endpoint=SGLangBackend.health_endpoint)
