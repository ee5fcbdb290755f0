"""Everything megarl says to an SGLang server: its native ``/generate`` dialect, its launch command,
and the trainer's control calls (weight updates, LoRA adapters, probe scoring).

:class:`SGLangBackend` is the rollout side's dialect, :class:`SGLangControl` the trainer's handle on
one server; both speak through :mod:`megarl.serving.http`.

Payloads follow SGLang 0.5's own request schema (``sglang.api.v1.api_types``:
``GenerateRequest`` / ``SamplingParams`` / ``GenerateResponse``; the tests validate
them there). ``/pause_generation`` with ``mode: "abort"`` ends in-flight requests with
``meta_info.finish_reason.type == "abort"`` and the tokens so far;
``/continue_generation`` resumes; ``/flush_cache`` drops the radix cache that new
weights make stale (it only works while nothing runs, i.e. while paused).

Weight updates: SGLang is its own receiver. Its workers join a group with
``/init_weights_update_group`` (the trainer's sender at group rank 0, SGLang's TP ranks at
``rank_offset + tp_rank``) and take in each bucket with ``/update_weights_from_distributed``
(``load_format: "flattened_bucket"``: one uint8 buffer per bucket, tensors back to back) between
``/begin_weight_update`` and ``/end_weight_update``; ``/update_weights_from_disk`` loads an HF
directory. Payload field names are those of ``sglang.srt.managers.io_struct``
(``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``UpdateWeightFromDiskReqInput``, ``UpdateWeightVersionReqInput``, ...); the tests validate them
against those classes. LoRA adapters (adapter weight sync, servers started with ``--enable-lora``):
``/load_lora_adapter`` (``LoadLoRAAdapterReqInput``), ``/unload_lora_adapter``
(``UnloadLoRAAdapterReqInput``); a ``/generate`` request names its adapter in ``lora_path``.

Limits: SGLang has no route that receives pre-sharded slices over a group (its
``update_weights_from_tensor`` passes CUDA IPC handles on one machine), so sharded mode is
vLLM-only. SGLang loads each bucket as it arrives: a failure mid-transfer leaves the server
half-updated, and the bridge marks it unhealthy.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.rollout import SGLangConfig
from megarl.serving.backend import (
    NO_PENALTIES,
    GenerationChunk,
    HttpCall,
    InferenceBackend,
    each_of_top_k,
    split_routes,
)
from megarl.serving.control import ServerControl, ServerControlError
from megarl.serving.http import MalformedResponseError, http_json
from megarl.serving.init_specs import worker_specs
from megarl.serving.launch import LaunchSpec
from megarl.utils.auth import api_key, server_guard_env
from megarl.utils.hardware import concrete_dtype

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangBackend(InferenceBackend):
    """Generation through SGLang's ``/generate`` with ``input_ids``."""

    name = "sglang"
    generate_endpoint = "/generate"
    health_endpoint = "/health"

    def generate_payload(
        self,
        input_ids: list[int],
        gconfig: GenerationHyperparameters,
        max_new_tokens: int,
        min_new_tokens: int,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        # every field named: SGLang fills one left out from the model's generation_config.json
        # (--sampling-defaults model, its default), e.g. Qwen2.5-Instruct's top_k 20
        sampling: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": min_new_tokens,
            "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
            "top_p": 1.0 if gconfig.greedy else gconfig.top_p,
            "top_k": 1 if gconfig.greedy else (gconfig.top_k if gconfig.top_k > 0 else -1),
            "min_p": 0.0 if gconfig.greedy else gconfig.min_p,
            **NO_PENALTIES,
            "skip_special_tokens": False,
        }
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
        if adapter is not None:
            payload["lora_path"] = adapter  # a loaded adapter's name (GenerateReqInput.lora_path)
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

    def score_payload(self, prompt: list[int] | str, top_k: int = 0) -> dict[str, Any]:
        body = {
            ("text" if isinstance(prompt, str) else "input_ids"): prompt,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0, "skip_special_tokens": False},
            "return_logprob": True,
            "logprob_start_len": 0,
            "stream": False,
        }
        if top_k:
            body["top_logprobs_num"] = top_k
        return body

    def parse_score(self, body: Any) -> list[tuple[int, float]]:
        try:
            entries = body["meta_info"]["input_token_logprobs"]
            return [(int(e[1]), float(e[0])) for e in entries[1:]]  # the first token has no logprob (None)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise MalformedResponseError(
                f"not a /generate reply with input_token_logprobs ({type(e).__name__}: {e})"
            ) from None

    def parse_top_k(self, body: Any, k: int) -> list[list[tuple[int, float]]]:
        # each position: [logprob, token id, text or None], most likely first (TokenizerManager's meta_info)
        try:
            entries = body["meta_info"]["input_top_logprobs"][1:]
            top = [[(int(e[1]), float(e[0])) for e in entry[:k]] for entry in entries]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise MalformedResponseError(
                f"not a /generate reply with input_top_logprobs ({type(e).__name__}: {e})"
            ) from None
        return each_of_top_k(top, k, "meta_info.input_top_logprobs")

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

    It is guarded by this process's ``$MEGARL_API_KEY``; without one, ``insecure`` says that it serves every
    route (its weight-update routes included) to anyone who reaches ``host``. Without either: on loopback a
    key made for this process (:func:`~megarl.utils.auth.server_guard_env`), elsewhere a ``ValueError``."""
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
    env = server_guard_env(host, insecure, f"SGLang server {replica}")
    if api_key():
        cmd += ["--api-key", api_key()]  # all but /health*, /ready*, /metrics (no env variable)
    if devices is not None:
        if len(devices) != tp:
            raise ValueError(f"sglang_launch_spec: tp={tp} needs {tp} devices, got {list(devices)}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    cmd += list(config.extra_args)
    return LaunchSpec(cmd=cmd, env=env, host=host, port=port, health_endpoint=SGLangBackend.health_endpoint)


# -------------------- the trainer's control calls (weight updates, LoRA adapters, probes)

DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def _check(address: str, route: str, reply) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise ServerControlError(address, route, str(reply.get("message") or reply.get("error_message")))


class SGLangControl(ServerControl):
    """An SGLang server; broadcast and disk modes."""

    name = "sglang"
    dialect = SGLangBackend

    def __init__(self, address: str, tp: int, timeout: float = 600.0):
        super().__init__(address, tp, timeout)
        self._groups: list[str] = []
        self._buckets: list[list[list]] = []
        self._dtype = "bfloat16"
        self._disk: str | None = None

    # payloads (plain dicts, checked against SGLang's request classes by the tests)

    def init_payloads(self, init_info: dict) -> list[dict]:
        """One ``/init_weights_update_group`` body per broadcast sender group."""
        wiring, offset = init_info["wiring"], init_info["worker_offset"]
        return [
            {
                "master_address": g["host"],
                "master_port": g["port"],
                "rank_offset": 1 + offset,
                "world_size": g["world_size"],
                "group_name": g["name"],
                "backend": wiring["backend"],
            }
            for g in wiring["broadcast"]
        ]

    def bucket_payloads(self) -> list[dict]:
        """One ``/update_weights_from_distributed`` body per bucket, in schedule order."""
        out = []
        for group, buckets in zip(self._groups, self._buckets):
            for entries in buckets:
                out.append(
                    {
                        "names": [n for n, _ in entries],
                        "dtypes": [self._dtype] * len(entries),
                        "shapes": [list(s) for _, s in entries],
                        "group_name": group,
                        "flush_cache": False,
                        "load_format": "flattened_bucket",
                    }
                )
        return out

    # ServerControl

    def init_group(self, init_info: dict) -> None:
        modes = worker_specs(init_info["specs"], init_info.get("shared"), 0)
        if "sharded" in modes:
            raise ValueError(f"SGLang server {self.address}: only broadcast and disk modes (no sharded receive API)")
        if "broadcast" not in modes:  # disk mode only: the server reads each version from the path, no group
            self._groups, self._buckets = [], []
            return
        spec = modes["broadcast"]
        self._groups = [g["name"] for g in init_info["wiring"]["broadcast"]]
        self._buckets, self._dtype = spec["buckets"], DTYPE_NAMES[init_info["dtype"]]
        for payload in self.init_payloads(init_info):
            _check(
                self.address,
                "/init_weights_update_group",
                http_json(self.address, "/init_weights_update_group", payload, self.timeout),
            )

    def begin(self, mode: str) -> None:
        if mode == "sharded":
            raise ValueError(f"SGLang server {self.address}: sharded mode is not supported (no sharded receive API)")
        self._disk = None
        if mode == "broadcast":
            _check(
                self.address, "/begin_weight_update", http_json(self.address, "/begin_weight_update", {}, self.timeout)
            )

    def receive(self, mode: str, path: str | None = None) -> None:
        if mode == "disk":
            self._disk = path
            return
        for payload in self.bucket_payloads():
            _check(
                self.address,
                "/update_weights_from_distributed",
                http_json(self.address, "/update_weights_from_distributed", payload, self.timeout),
            )

    def commit(self, version: int) -> None:
        if self._disk is not None:
            body = {"model_path": self._disk, "weight_version": str(version), "flush_cache": True}
            _check(
                self.address,
                "/update_weights_from_disk",
                http_json(self.address, "/update_weights_from_disk", body, self.timeout),
            )
            return
        _check(self.address, "/end_weight_update", http_json(self.address, "/end_weight_update", {}, self.timeout))
        body = {"new_version": str(version), "abort_all_requests": False}
        http_json(self.address, "/update_weight_version", body, self.timeout)
        http_json(self.address, "/flush_cache", None, self.timeout)

    def load_adapter(self, name: str, path: str, replace: bool = False) -> None:
        if replace:  # the same version pushed again: SGLang refuses a name it holds
            try:
                self.unload_adapter(name)
            except ServerControlError:
                pass  # a restarted server holds none
        route = "/load_lora_adapter"
        _check(self.address, route, http_json(self.address, route, self.adapter_payload(name, path), self.timeout))

    def unload_adapter(self, name: str) -> None:
        route = "/unload_lora_adapter"
        _check(self.address, route, http_json(self.address, route, {"lora_name": name}, self.timeout))

    @staticmethod
    def adapter_payload(name: str, path: str) -> dict:
        """The ``/load_lora_adapter`` body (``LoadLoRAAdapterReqInput``)."""
        return {"lora_name": name, "lora_path": path}

    @staticmethod
    def score_payload(seq: list[int], k: int = 0, adapter: str | None = None) -> dict:
        """The ``/generate`` body that scores ``seq`` (``GenerateReqInput``): the logprob of each of its
        tokens, and with ``k`` > 0 the ``k`` most likely tokens at each position too; under the loaded LoRA
        ``adapter`` (``lora_path`` takes its name) if given."""
        body = {
            "input_ids": list(seq),
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        if k > 0:
            body["top_logprobs_num"] = k
        if adapter is not None:
            body["lora_path"] = adapter
        return body

    def _positions(self, seq: list[int], reply: Any, field: str) -> list:
        """``meta_info[field]`` of the reply scoring ``seq``, past its first token (which has none)."""
        try:
            entries = reply["meta_info"][field][1:]
        except (KeyError, IndexError, TypeError) as e:
            raise ServerControlError(self.address, "/generate", f"no {field} in reply ({e})") from None
        if len(entries) != len(seq) - 1:
            raise ServerControlError(
                self.address, "/generate", f"{field} has {len(entries)} positions for {len(seq) - 1} tokens"
            )
        return entries

    async def _probe_one(self, seq: list[int], k: int, adapter: str | None) -> tuple[list[float], list | None]:
        """One ``/generate`` scoring ``seq``: each token's logprob (``input_token_logprobs``, entries of
        (logprob, token_id, text or None)) and, with ``k`` > 0, the k most likely tokens at each position,
        most likely first (``input_top_logprobs``, ``TokenizerManager.add_logprob_to_meta_info``)."""
        reply = await self._ajson("/generate", self.score_payload(seq, k, adapter))
        field = "input_token_logprobs"
        try:
            scores = [float(e[0]) for e in self._positions(seq, reply, field)]
            if k <= 0:
                return scores, None
            field = "input_top_logprobs"
            tops = self._positions(seq, reply, field)
            return scores, [{int(tok): float(logprob) for logprob, tok, _ in entry[:k]} for entry in tops]
        except (IndexError, TypeError, ValueError) as e:
            raise ServerControlError(self.address, "/generate", f"malformed {field} ({e})") from None

    async def aprobe(
        self, sequences: list[list[int]], k: int, adapter: str | None = None
    ) -> tuple[list[list[float]], list[list[dict[int, float]]] | None]:
        """One ``/generate`` per sequence, all at once, each answering both the scores and the top k."""
        replies = await asyncio.gather(*(self._probe_one(seq, k, adapter) for seq in sequences))
        scores = [scored for scored, _ in replies]
        return scores, [top for _, top in replies] if k > 0 else None

    async def ascore(self, sequences: list[list[int]], adapter: str | None = None) -> list[list[float]]:
        return (await self.aprobe(sequences, 0, adapter))[0]

    async def ascore_topk(
        self, sequences: list[list[int]], k: int, adapter: str | None = None
    ) -> list[list[dict[int, float]]]:
        return (await self.aprobe(sequences, k, adapter))[1]
