"""Many simulated inference servers in one process: the cluster of ``benchmarks/scale_sim.py``.

Each server is its own HTTP endpoint (its own port) speaking vLLM's or SGLang's real routes, as
``tests/rollout/fake_server.py`` does (this module reuses its :class:`FakeServer`: generation
dialects, pause / resume, sleep / wake, injected faults), with what a cluster of GPUs adds:

* **continuous batching.** A server's throughput at concurrency ``c`` is
  ``peak * c / (c + half)`` tokens/s, shared by its ``c`` running requests: one request alone
  decodes at ``peak / (1 + half)`` tokens/s, and each one slows as more join, as with vLLM. A
  request first waits ``ttft`` seconds (prefill). One ticker per process advances every running
  request every ``TICK`` seconds, so the process's wake-ups do not grow with the requests.
* **answer lengths.** The number of tokens an answer has is drawn from a log-normal distribution
  (``mean_tokens``, ``sigma``, capped at the request's ``max_tokens``) seeded by the request's first
  ``prompt_len`` tokens: a generation interrupted by a pause and continued (the prompt then holds
  the first part of the answer) ends at the same token as an uninterrupted one. Tokens and
  logprobs are the fake server's (``token_at``, ``logprob_at``) and the last one is EOS, so the
  benchmark checks every row it gets token by token.
* **weight updates.** vLLM's ``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, megarl's one-call update route, and SGLang's
  ``/update_weights_from_disk``, ``/update_weight_version``; receiving takes ``model_bytes / (tp *
  bytes_per_s)`` seconds (the bytes a TP rank loads at its link's rate), then the server serves the
  new version. In ``sharded`` mode each of a server's ``--tp`` workers joins the trainer's group for
  real (``/init_weight_transfer_engine``: a ``TCPStore`` client and a gloo process group of this
  process, as rank ``senders + worker``) and receives its slices of every update over it, message by
  message as its receive schedule says (:class:`GroupReceiver`), before the simulated load time.
  Run the hosts and the trainer with ``TORCH_GLOO_LAZY_INIT=1``: gloo then connects only the pairs
  that exchange messages (each worker with its senders), as NCCL connects at first use; without it
  a group of W members opens W^2 connections at once.
* **the consistency probe.** Scoring requests (vLLM's ``prompt_logprobs``, SGLang's
  ``return_logprob``) are answered by a real HF model: the directory given at start, then each
  update's directory (disk mode writes a complete HF checkpoint), loaded once per process and
  version, so the trainer's probe compares real numbers.
* **faults, per server** (``POST /_host/fault {"index": i, ...}`` to any live server of its process): ``{"die": true}`` stops listening and drops every open
  connection (a SIGKILLed server, as its clients see it), ``{"restart": true}`` listens again with
  the model's first weights (the launcher's restart in the slot); ``{"slow": 10}`` divides its throughput
  by 10; ``{"hang_update": true}`` accepts the next weight-update request and never answers;
  ``{"pause_delay": s}`` makes each update call take ``s`` seconds to pause (a slow ``/pause``);
  ``{"receive_factor": f}`` makes its weight load ``f`` times slower (a slow receive);
  ``{"control_down": true}`` hangs its update calls before they pause while ``/health`` answers.
  The fake server's ``/_faults`` queue (a burst of 429s ...) works as before.

``GET /_host`` (any live server of the process) returns every server's counters at once (tokens,
requests, and seconds alive, unpaused and busy: see :meth:`SimServer.tick`).

Run: ``python tests/scale/sim_host.py --ports 20000,20001,... --dialect vllm [--model DIR] ...``;
it prints ``ready`` once every port listens.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextvars
import datetime
import faulthandler
import hashlib
import logging
import math
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megarl.serving.http import SERVER_KEEPALIVE_S  # noqa: E402
from megarl.serving.vllm import UPDATE_ROUTE  # noqa: E402
from tests.rollout.fake_server import EOS, FakeServer, logprob_at, serve_update_route, token_at  # noqa: E402

REQUEST_TRANSPORT: contextvars.ContextVar = contextvars.ContextVar("request_transport", default=None)
"""The connection of the request a handler task serves (dropped when its server "dies")."""

TICK = 0.05
"""Seconds between two advances of every running request (one ticker per process)."""
JOINS = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="sim-join")
"""Where the workers of this process join their groups (a blocking rendezvous each)."""
RECEIVES = concurrent.futures.ThreadPoolExecutor(256, thread_name_prefix="sim-receive")
"""Where each server posts an update's receives (every server of the process at once)."""


@dataclass(frozen=True)
class ServingModel:
    """How fast one simulated server generates."""

    peak_tokens_per_s: float = 2000.0
    """Throughput at saturation (all requests together)."""
    half_concurrency: float = 16.0
    """The concurrency at which the server gives half its peak."""
    ttft_s: float = 0.05
    """Seconds before a request's first token (prefill)."""
    mean_tokens: float = 300.0
    """Mean answer length (log-normal)."""
    sigma: float = 0.6
    """The log-normal's sigma: the answer lengths' long tail."""

    def throughput(self, concurrency: float) -> float:
        """Tokens/s of one server running ``concurrency`` requests."""
        return self.peak_tokens_per_s * concurrency / (concurrency + self.half_concurrency)

    def answer_tokens(self, prompt_key: bytes) -> int:
        """The length of the answer to a prompt (at least 1), the same for every call with that prompt."""
        rng = random.Random(hashlib.sha256(prompt_key).digest())
        mu = math.log(self.mean_tokens) - self.sigma**2 / 2  # so that the mean is mean_tokens
        return max(1, round(rng.lognormvariate(mu, self.sigma)))


@dataclass(frozen=True)
class WeightLoad:
    """How long a server takes to receive new weights."""

    model_bytes: float = 15.2e9
    bytes_per_s: float = 25e9
    tp: int = 1

    @property
    def seconds(self) -> float:
        return self.model_bytes / (self.tp * self.bytes_per_s)


@dataclass
class Generation:
    """One running request: how many of its tokens are out, and how many it will have."""

    start_pos: int
    target: int
    stops: bool
    """Whether the answer ends with EOS at ``target`` (else the request's max_tokens cut it)."""
    started: float
    done: asyncio.Future
    transport: asyncio.BaseTransport | None
    progress: float = 0.0

    def tokens(self, n: int, finish: str) -> tuple[list[int], str]:
        out = [token_at(self.start_pos + i, 0) for i in range(n)]
        if finish == "stop":
            out[-1] = EOS
        return out, finish


class Scorer:
    """Real logprobs of a sequence under the weights a server holds (an HF model directory)."""

    def __init__(self, model_dir: str | None):
        self.model_dir = model_dir
        self.models: dict[str, object] = {}
        self.loading: dict[str, asyncio.Future] = {}

    def logprobs(self, weights: str | None, seq: list[int], k: int) -> list[tuple[float, dict[int, float]]]:
        """For each position past the first: (logprob of the sequence's token, its ``k`` most likely tokens)."""
        import torch

        model = self._model(weights or self.model_dir)
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, :-1].float()
        logp = logits.log_softmax(-1)
        chosen = logp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()
        if k == 0:
            return [(lp, {}) for lp in chosen]
        values, ids = logp.topk(k, dim=-1)
        return [
            (lp, dict(zip(i.tolist(), v.tolist(), strict=True))) for lp, v, i in zip(chosen, values, ids, strict=True)
        ]

    def preload(self, path: str | None) -> asyncio.Future:
        """Load ``path`` in a thread, once per process however many servers ask (None: nothing to load)."""
        loop = asyncio.get_running_loop()
        path = path or self.model_dir
        if path is None or path in self.models:
            future = loop.create_future()
            future.set_result(None)
            return future
        if path not in self.loading:
            self.loading = {path: loop.run_in_executor(None, self._model, path)}  # one version at a time
        return self.loading[path]

    def _model(self, path: str | None):
        if path is None:
            raise web.HTTPBadRequest(text="this simulated cluster was started without --model: it cannot score")
        if path not in self.models:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
            self.models = {**dict(list(self.models.items())[-1:]), path: model}  # this version and the last
        return self.models[path]


class GroupReceiver:
    """One simulated server's workers in the trainer's sharded group: joined at init, then each update's
    slices received over it, message by message as each worker's receive schedule says (the data is
    counted, not applied: the simulated model does not change)."""

    def __init__(self, init_info: dict, tp: int):
        from megarl.bridge.receiver import ReceiverInit
        from megarl.bridge.wiring import Wiring

        self.init = ReceiverInit(**init_info)
        self.wiring = Wiring.from_json(self.init.wiring)
        self.specs = [self.init.worker_specs(r).get("sharded") for r in range(tp)]
        self.groups: list = []

    def join(self) -> None:
        """Every worker joins the sharded group (blocking: run it in a thread)."""
        import torch.distributed as dist

        spec, timeout = self.wiring.sharded, datetime.timedelta(seconds=self.init.timeout)
        senders = len(self.wiring.sharded_members)
        for r in range(len(self.specs)):
            rank = senders + self.init.worker_offset + r
            store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout)
            # the keys megarl.bridge.groups.join_group's helper uses: <name>/<name>/cpu/...
            prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{spec.name}/", dist.PrefixStore(spec.name, store)))
            self.groups.append(dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout))

    async def receive(self) -> int:
        """One update's messages to every worker of the server, in a thread of its own (a gloo receive
        completes only in ``wait``; a pair's first message waits for its sender to connect); the bytes
        received. Raises if a message failed."""
        return await asyncio.get_running_loop().run_in_executor(RECEIVES, self._receive)

    def _receive(self) -> int:
        works = self._post()
        for _, work in works:
            work.wait()  # raises the message's error
        return sum(buf.numel() * buf.element_size() for buf, _ in works)

    def _post(self) -> list:
        import torch

        from megarl.bridge.transport import wire_dtype

        dtype, works = wire_dtype(self.init.dtype), []
        for group, spec in zip(self.groups, self.specs, strict=True):
            shapes = [tuple(t[2]) for t in spec["tensors"]]
            for msgs in spec["rounds"]:
                for sender, pieces in msgs:
                    numel = sum(_piece_numel(shapes[slot], dim, length) for slot, dim, _, length in pieces)
                    buf = torch.empty(numel, dtype=dtype)
                    works.append((buf, group.recv([buf], spec["sender_ranks"][sender], 0)))
        return works

    def abort(self) -> None:
        """Drop the groups as a killed process would: the trainer's sends to them fail."""
        for group in self.groups:
            group.abort()
        self.groups = []


def _piece_numel(shape: tuple[int, ...], dim: int | None, length: int) -> int:
    return math.prod(length if d == dim else n for d, n in enumerate(shape))


class SimServer(FakeServer):
    """One simulated server (see the module doc)."""

    def __init__(self, index: int, dialect: str, serving: ServingModel, load: WeightLoad, prompt_len: int, scorer):
        super().__init__(dialect, token_delay=0.0, eos_every=0)
        self.index, self.serving, self.load, self.prompt_len, self.scorer = index, serving, load, prompt_len, scorer
        self.active: list[Generation] = []
        self.slowdown = 1.0
        self.hang_update = False
        self.pause_delay = 0.0  # seconds its update call takes to pause (a slow /pause)
        self.receive_factor = 1.0  # its weight load takes this many times the others' (a slow receive)
        self.control_down = False  # its update call hangs before pausing while /health answers
        self.dead = False
        self.version = 0
        self.weights: str | None = None  # the directory of the weights it serves (None: the model it started with)
        self.pending: str | None = None
        self.group: GroupReceiver | None = None  # its workers in the trainer's sharded group
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.counters = {
            "tokens": 0.0,
            "requests": 0,
            "aborted": 0,
            "updates": 0,
            "unpaused_s": 0.0,
            "running_s": 0.0,
            "alive_s": 0.0,
            "busy_s": 0.0,
            "bytes_received": 0,
        }
        # the fake server keeps every request's body for its tests; a simulated cluster serves millions
        self.payloads = collections.deque(maxlen=16)

    # ---------------------------------------------------------------- generation

    async def generate_tokens(self, prompt: list[int], max_new: int, exact: bool = False) -> tuple[list[int], str]:
        await self.resumed.wait()
        answer = max_new if exact else self.serving.answer_tokens(repr(prompt[: self.prompt_len]).encode())
        left = answer - (len(prompt) - self.prompt_len) if not exact else max_new
        target, stops = (left, True) if 0 < left <= max_new else (max_new, False)
        if target <= 0:
            return [EOS], "stop"
        loop = asyncio.get_running_loop()
        gen = Generation(
            len(prompt), target, stops and not exact, loop.time(), loop.create_future(), REQUEST_TRANSPORT.get()
        )
        self.active.append(gen)
        self.counters["requests"] += 1
        try:
            return await gen.done
        finally:
            if gen in self.active:
                self.active.remove(gen)

    def tick(self, dt: float, now: float) -> None:
        """Advance every running request by ``dt`` seconds of decoding (abort them all while paused).

        Counters: ``alive_s`` (every tick, paused or not), ``unpaused_s``, ``busy_s`` (unpaused with a
        request in prefill or decoding: 1 - busy_s / alive_s is the server's idle share, paused included)
        and ``running_s`` (requests decoding x seconds)."""
        self.counters["alive_s"] += dt
        if not self.resumed.is_set():
            for gen in list(self.active):
                n = int(gen.progress)
                if not gen.done.done():
                    gen.done.set_result(gen.tokens(n, "abort"))
                    self.counters["aborted"] += 1
            self.active.clear()
            return
        self.counters["unpaused_s"] += dt
        self.counters["busy_s"] += dt if self.active else 0.0
        running = [g for g in self.active if now - g.started >= self.serving.ttft_s]
        if not running:
            return
        self.counters["running_s"] += len(running) * dt  # / unpaused_s: the mean concurrency decoding
        rate = self.serving.throughput(len(running)) / self.slowdown
        per_request = rate / len(running) * dt
        for gen in running:
            before = gen.progress
            gen.progress = min(gen.target, gen.progress + per_request)
            self.counters["tokens"] += gen.progress - before
            if gen.progress >= gen.target and not gen.done.done():
                gen.done.set_result(gen.tokens(gen.target, "stop" if gen.stops else "length"))
                self.active.remove(gen)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        REQUEST_TRANSPORT.set(request.transport)
        body = await request.json()  # aiohttp keeps the body: the parent's handler reads it again
        if body.get("prompt_logprobs") is not None:
            await self.scorer.preload(self.weights)
            return web.json_response(await asyncio.to_thread(self._vllm_scores, body))  # the loop serves on
        if body.get("min_tokens"):  # the consistency probe samples exactly max_tokens
            out, _ = await self.generate_tokens(body["prompt"], body["max_tokens"], exact=True)
            choice = {"index": 0, "token_ids": out, "finish_reason": "length"}
            if body.get("logprobs") is not None:  # as vLLM: the sampled tokens' logprobs when asked
                n0 = len(body["prompt"])
                lps = [logprob_at(n0 + i) for i in range(len(out))]
                choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in out], "token_logprobs": lps}
            return web.json_response({"choices": [choice]})
        return await super().completions(request)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        REQUEST_TRANSPORT.set(request.transport)
        body = await request.json()
        if body.get("return_logprob") and body.get("logprob_start_len") == 0:
            await self.scorer.preload(self.weights)
            return web.json_response(await asyncio.to_thread(self._sglang_scores, body))
        return await super().generate(request)

    def _vllm_scores(self, body: dict) -> dict:
        """As vLLM's ``/v1/completions`` with ``prompt_logprobs``: one choice per prompt (a prompt of token ids,
        or a list of them), each position's own token and its top k."""
        prompts, k = body["prompt"], int(body["prompt_logprobs"])
        prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
        choices = []
        for index, seq in enumerate(prompts):
            entries: list = [None]
            for tok, (lp, top) in zip(seq[1:], self.scorer.logprobs(self.weights, seq, k), strict=True):
                ranked = {str(t): {"logprob": v, "rank": r + 1} for r, (t, v) in enumerate(top.items())}
                ranked.setdefault(str(tok), {"logprob": lp, "rank": k + 1})
                entries.append(ranked)
            choices.append({"index": index, "token_ids": [EOS], "prompt_logprobs": entries, "finish_reason": "length"})
        return {"choices": choices}

    def _sglang_scores(self, body: dict) -> dict:
        seq, k = body["input_ids"], int(body.get("top_logprobs_num", 0))
        scored = self.scorer.logprobs(self.weights, seq, k)
        meta = {"input_token_logprobs": [[None, seq[0], None]] + [[lp, t, None] for (lp, _), t in zip(scored, seq[1:])]}
        if k:
            meta["input_top_logprobs"] = [None] + [[[v, t, None] for t, v in top.items()] for _, top in scored]
        return {"text": "", "output_ids": [EOS], "meta_info": meta}

    # ---------------------------------------------------------------- weight updates

    async def _receive(self, path: str | None, mode: str = "disk") -> None:
        if self.hang_update:
            self.hang_update = False
            await asyncio.sleep(10**6)
        if mode == "sharded":
            if self.group is None:
                raise web.HTTPBadRequest(text="a sharded update before /init_weight_transfer_engine")
            self.counters["bytes_received"] += await self.group.receive()
        if self.scorer.model_dir is not None:  # a host started without --model scores nothing: no load
            self.scorer.preload(path)  # in a thread: the simulated receive time stays what it is
        await asyncio.sleep(self.load.seconds * self.receive_factor)
        self.pending = path

    async def vllm_update(self, request: web.Request) -> web.Response:
        info = (await request.json())["update_info"]
        await self._receive(info.get("path"), info.get("mode", "disk"))
        return web.json_response({})

    async def vllm_update_in_one_call(self, request: web.Request) -> web.StreamResponse:
        return await serve_update_route(request, _Steps(self))

    async def vllm_init(self, request: web.Request) -> web.Response:
        """Join the trainer's sharded group (its workers' ends; the old ones dropped), if the wiring has one."""
        info = (await request.json())["init_info"]
        if self.group is not None:
            self.group.abort()
            self.group = None
        if info["wiring"].get("sharded"):
            group = GroupReceiver(info, self.load.tp)
            await asyncio.get_running_loop().run_in_executor(JOINS, group.join)
            self.group = group
        return web.json_response({})

    async def vllm_finish(self, request: web.Request) -> web.Response:
        self._commit((await request.json())["weight_version"])
        return web.json_response({})

    async def sglang_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        await self._receive(body["model_path"])
        self._commit(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def sglang_version(self, request: web.Request) -> web.Response:
        self._commit((await request.json())["new_version"])
        return web.json_response({"success": True})

    def _commit(self, version: str) -> None:
        self.version = int(version)
        self.weights = self.pending or self.weights
        self.counters["updates"] += 1

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": ""})

    async def lora_text(self, request: web.Request) -> web.Response:
        return web.Response(text="Success: LoRA adapter loaded")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim", "object": "model"}]})

    # ---------------------------------------------------------------- faults and counters

    async def apply(self, body: dict) -> None:
        """One of the faults (the module doc) on this server."""
        self.slowdown = float(body.get("slow", self.slowdown))
        self.hang_update = bool(body.get("hang_update", self.hang_update))
        self.pause_delay = float(body.get("pause_delay", self.pause_delay))
        self.receive_factor = float(body.get("receive_factor", self.receive_factor))
        self.control_down = bool(body.get("control_down", self.control_down))
        if body.get("die"):
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.die()))
        if body.get("restart"):
            await self.restart()

    async def restart(self) -> None:
        """Listen again, as the launcher's restart of a dead server in its slot: the model's first weights,
        version 0, no request running."""
        if not self.dead:
            return
        self.dead, self.version, self.weights, self.pending = False, 0, None, None
        self.resumed.set()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, backlog=1024).start()

    async def die(self) -> None:
        """Stop listening and drop every connection, as a killed process would."""
        self.dead = True
        if self.group is not None:
            self.group.abort()
            self.group = None
        for gen in self.active:
            if gen.transport is not None:
                gen.transport.abort()
            gen.done.cancel()  # its handler ends; its client saw the connection drop
        self.active.clear()
        if self.runner is not None:
            for site in list(self.runner.sites):
                await site.stop()
            if self.runner.server is not None:
                for handler in list(self.runner.server.connections):
                    if handler.transport is not None:
                        handler.transport.abort()

    def snapshot(self) -> dict:
        return {
            "index": self.index,
            "version": self.version,
            "dead": self.dead,
            "paused": not self.resumed.is_set(),
            "running": len(self.active),
            **self.counters,
            **{k: v for k, v in self.stats.items()},
        }

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/v1/models", self.models)
        if self.dialect == "vllm":
            app.router.add_post("/init_weight_transfer_engine", self.vllm_init)
            app.router.add_post("/start_weight_update", self.ok)
            app.router.add_post("/update_weights", self.vllm_update)
            app.router.add_post("/finish_weight_update", self.vllm_finish)
            app.router.add_post(UPDATE_ROUTE, self.vllm_update_in_one_call)
            app.router.add_post("/v1/load_lora_adapter", self.lora_text)
            app.router.add_post("/v1/unload_lora_adapter", self.lora_text)
        else:
            app.router.add_post("/update_weights_from_disk", self.sglang_from_disk)
            app.router.add_post("/update_weight_version", self.sglang_version)
            app.router.add_post("/load_lora_adapter", self.ok)
            app.router.add_post("/unload_lora_adapter", self.ok)
        return app


class _Steps:
    """A simulated server's steps of megarl's one-call update (``megarl.serving.vllm_route.UpdateSteps``)."""

    def __init__(self, server: SimServer):
        self.server = server

    async def pause(self) -> None:
        if self.server.control_down:
            await asyncio.sleep(10**6)
        await asyncio.sleep(self.server.pause_delay)
        self.server.resumed.clear()  # the ticker aborts the running requests, as /pause?mode=abort

    async def start(self) -> None:
        pass

    async def receive(self, mode: str, path: str | None) -> None:
        await self.server._receive(path, mode)

    async def finish(self, version: str) -> None:
        self.server._commit(version)

    async def resume(self) -> None:
        self.server.resumed.set()


@dataclass
class Host:
    """The servers of this process and their ticker."""

    servers: list[SimServer] = field(default_factory=list)

    async def tick_forever(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(TICK)
            now = loop.time()
            for server in self.servers:
                if not server.dead:
                    server.tick(now - last, now)
            last = now

    async def host_stats(self, request: web.Request) -> web.Response:
        return web.json_response([s.snapshot() for s in self.servers])

    async def host_fault(self, request: web.Request) -> web.Response:
        """``POST /_host/fault {"index": i, ...}`` on any live server of the process: a fault on server i
        (which may not listen, being "dead")."""
        body = await request.json()
        server = next(s for s in self.servers if s.index == body["index"])
        await server.apply(body)
        return web.json_response({"index": server.index})


async def serve(args: argparse.Namespace) -> None:
    serving = ServingModel(args.peak_tokens_per_s, args.half_concurrency, args.ttft, args.mean_tokens, args.sigma)
    load = WeightLoad(args.model_bytes, args.bytes_per_s, args.tp)
    scorer = Scorer(args.model)
    if args.model:
        import torch

        torch.set_num_threads(1)  # the host's scoring must not take the cores the client under test runs on
        await scorer.preload(args.model)  # torch and transformers imported before the first probe
    host = Host()
    for i, port in enumerate(int(p) for p in args.ports.split(",")):
        server = SimServer(args.first_index + i, args.dialect, serving, load, args.prompt_len, scorer)
        app = server.app()
        app.router.add_get("/_host", host.host_stats)
        app.router.add_post("/_host/fault", host.host_fault)
        # idle connections kept as the vLLM servers megarl starts keep them (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2, keepalive_timeout=SERVER_KEEPALIVE_S)
        server.runner, server.port = runner, port
        await server.runner.setup()
        await web.TCPSite(server.runner, "127.0.0.1", port, backlog=1024).start()
        host.servers.append(server)
    print("ready", flush=True)
    await host.tick_forever()


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: every thread's stack on stderr (a hang's)
    logging.basicConfig(level=logging.WARNING, format="sim host %(process)d: %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description="many simulated inference servers in one process")
    parser.add_argument("--ports", required=True, help="comma-separated ports, one server each")
    parser.add_argument("--first-index", type=int, default=0, help="the index of the first server (for its counters)")
    parser.add_argument("--dialect", choices=["vllm", "sglang"], default="vllm")
    parser.add_argument("--model", default=None, help="HF directory the servers start with (scores the probe)")
    parser.add_argument(
        "--prompt-len", type=int, required=True, help="tokens of the prompt that seed its answer length"
    )
    parser.add_argument("--peak-tokens-per-s", type=float, default=ServingModel.peak_tokens_per_s)
    parser.add_argument("--half-concurrency", type=float, default=ServingModel.half_concurrency)
    parser.add_argument("--ttft", type=float, default=ServingModel.ttft_s)
    parser.add_argument("--mean-tokens", type=float, default=ServingModel.mean_tokens)
    parser.add_argument("--sigma", type=float, default=ServingModel.sigma)
    parser.add_argument("--model-bytes", type=float, default=WeightLoad.model_bytes)
    parser.add_argument("--bytes-per-s", type=float, default=WeightLoad.bytes_per_s)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    start = time.monotonic()
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    print(f"sim host: shut down after {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
