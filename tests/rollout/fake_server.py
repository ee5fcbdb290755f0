"""A fault-injecting fake inference server (vLLM or SGLang dialect), run as its own process.

Only for fault injection and SGLang (which cannot serve here). Generation is
deterministic in the absolute position ``p`` of a token (prompt included)::

    token(p)   = EOS if eos_every and p % eos_every == 0 else (p * 31 + 7) % 1000 + 10
    logprob(p) = -((p % 10) + 1) / 10

so a generation that is interrupted and continued must produce exactly the tokens of an
uninterrupted one, which lets tests check that nothing is lost or duplicated.

Control endpoints (test only): ``POST /_faults {"faults": [...]}`` queues faults that
the next generate requests consume one each: one of :data:`TRANSPORT_FAULTS` (an HTTP
status, a body that is not the endpoint's JSON, a reply that never ends or trickles, a
connection dropped before or in the middle of the body) or of :data:`CORRUPTIONS` (a
complete 200 reply that cannot be trained on). ``GET /_stats`` reports counters.
``--fail-rate F --delay-rate D --seed S`` adds random faults for load tests: each generate
request fails with probability F (a fault drawn from :data:`RANDOM_FAULTS`) or is delayed
by up to ``--max-delay`` seconds with probability D.

Run: ``python tests/rollout/fake_server.py --port P --dialect vllm|sglang``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import io
import json
import random

import numpy as np
from aiohttp import web

EOS = 2
VOCAB_SIZE = 1024
"""The fake model's vocabulary: every token it generates is below it (tests give the engine this size)."""


def routed_at(position: int) -> list[int]:
    """The fake MoE's experts for the forward at ``position``: 2 layers x top-2 of 8, layer-major."""
    return [position % 8, (position + 1) % 8, (position + 2) % 8, (position + 3) % 8]


def token_at(p: int, eos_every: int) -> int:
    if eos_every and p % eos_every == 0:
        return EOS
    return (p * 31 + 7) % 1000 + 10


def logprob_at(p: int) -> float:
    return -((p % 10) + 1) / 10


def _set_first(reply: dict, *, logprob=None, token=None) -> None:
    choice = reply["choices"][0]
    if logprob is not None:
        choice["logprobs"]["token_logprobs"][0] = logprob
    if token is not None:
        choice["token_ids"][0] = token
        choice["logprobs"]["tokens"][0] = f"token_id:{token}"


def _extra_token(reply: dict, max_tokens: int) -> None:
    choice = reply["choices"][0]
    while len(choice["token_ids"]) <= max_tokens:
        choice["token_ids"].append(7)
        choice["logprobs"]["tokens"].append("token_id:7")
        choice["logprobs"]["token_logprobs"].append(-0.5)


CORRUPTIONS = {  # a 200 reply (vLLM dialect) that megarl must not train on: (reply, max_tokens) -> None, in place
    "nan_logprob": lambda reply, n: _set_first(reply, logprob=float("nan")),
    "inf_logprob": lambda reply, n: _set_first(reply, logprob=float("-inf")),
    "positive_logprob": lambda reply, n: _set_first(reply, logprob=0.5),
    "negative_token": lambda reply, n: _set_first(reply, token=-5),
    "extra_tokens": _extra_token,
    "length_mismatch": lambda reply, n: reply["choices"][0]["logprobs"]["token_logprobs"].pop(),
    "unknown_finish": lambda reply, n: reply["choices"][0].update(finish_reason="banana"),
    "empty_choices": lambda reply, n: reply.update(choices=[]),
    "null_logprobs": lambda reply, n: reply["choices"][0].update(logprobs=None),
    "string_token": lambda reply, n: _set_first(reply, token="seven"),
    "null_logprob": lambda reply, n: reply["choices"][0]["logprobs"]["token_logprobs"].__setitem__(-1, None),
    "vocab_token": lambda reply, n: _set_first(reply, token=VOCAB_SIZE),
}
"""Fault names of corrupted complete replies, for ``POST /_faults``."""

TRANSPORT_FAULTS = {  # name -> what megarl must do with it: "retry" (then the clean sample), "fail" (at once) or
    # "deadline" (fail once the request's deadline, rollout.request_timeout, is spent: no time is left to retry)
    "500": "retry",  # internal server error
    "503": "retry",  # overloaded / starting
    "429": "retry",  # too many requests (Retry-After: 0)
    "408": "retry",  # request timeout
    "400": "fail",  # the request itself is wrong: retrying cannot help
    "404": "fail",  # no such route (a wrong endpoint or server kind)
    "malformed": "retry",  # 200, body not JSON
    "bad_shape": "retry",  # 200, JSON without the fields
    "empty_body": "retry",  # 200, nothing in the body
    "html": "retry",  # 200, an HTML page (a proxy's error page) instead of JSON
    "truncated": "retry",  # 200, the body cut in the middle (valid prefix, then EOF at the announced length)
    "hang": "deadline",  # never answers
    "trickle": "retry",  # headers, then a byte now and then, never the whole body
    "disconnect": "retry",  # the connection dropped before any reply
    "reset_mid_body": "retry",  # headers and half the body, then the connection dropped
}
"""Fault names of transport-level bad replies, for ``POST /_faults``, and the expected handling."""

RANDOM_FAULTS = [
    "500",
    "503",
    "429",
    "malformed",
    "html",
    "truncated",
    "reset_mid_body",
    "disconnect",
    "nan_logprob",
    "length_mismatch",
    "extra_tokens",
    "empty_choices",
]
"""The faults ``--fail-rate`` draws from: retryable ones (a 4xx or a hang would only test the budget)."""


class FakeServer:
    def __init__(
        self,
        dialect: str,
        token_delay: float,
        eos_every: int,
        fail_rate: float = 0.0,
        delay_rate: float = 0.0,
        max_delay: float = 0.0,
        seed: int = 0,
    ):
        self.dialect = dialect
        self.fail_rate, self.delay_rate, self.max_delay = fail_rate, delay_rate, max_delay
        self.rng = random.Random(seed)
        self.token_delay = token_delay
        self.eos_every = eos_every
        self.faults: collections.deque[str] = collections.deque()
        self.corrupt_next: str | None = None  # one of CORRUPTIONS, applied to the next complete reply
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.sleeping = False  # memory released (colocated placement): generating now is a bug
        self.stats = collections.Counter()
        self.payloads: list[dict] = []

    async def generate_tokens(self, prompt: list[int], max_new: int) -> tuple[list[int], str]:
        await self.resumed.wait()  # like vLLM: requests arriving while paused wait
        out: list[int] = []
        while len(out) < max_new:
            if not self.resumed.is_set():
                return out, "abort"
            await asyncio.sleep(self.token_delay)
            if not self.resumed.is_set():
                return out, "abort"
            if self.sleeping:
                self.stats["tokens_while_sleeping"] += 1
            token = token_at(len(prompt) + len(out), self.eos_every)
            out.append(token)
            if token == EOS:
                return out, "stop"
        return out, "length"

    def next_fault(self) -> str | None:
        if self.faults:
            return self.faults.popleft()
        if self.fail_rate and self.rng.random() < self.fail_rate:
            return self.rng.choice(RANDOM_FAULTS)
        return None

    async def maybe_fault(self, request: web.Request) -> web.StreamResponse | None:
        if self.delay_rate and self.rng.random() < self.delay_rate:
            self.stats["delayed"] += 1
            await asyncio.sleep(self.rng.uniform(0, self.max_delay))
        fault = self.next_fault()
        if fault is None or fault == "ok":  # "ok" queues a clean reply between faults
            return None
        self.stats[f"fault_{fault}"] += 1
        if fault in CORRUPTIONS:
            self.corrupt_next = fault
            return None
        if fault.isdigit():
            headers = {"Retry-After": "0"} if fault == "429" else None
            error = {"object": "error", "message": f"injected HTTP {fault}", "type": "Injected", "code": int(fault)}
            return web.json_response(error, status=int(fault), headers=headers)
        if fault == "malformed":
            return web.Response(status=200, text="{not json", content_type="application/json")
        if fault == "bad_shape":
            return web.json_response({"unexpected": True})
        if fault == "empty_body":
            return web.Response(status=200, body=b"", content_type="application/json")
        if fault == "html":
            return web.Response(status=200, text="<html><body>502 Bad Gateway</body></html>", content_type="text/html")
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "disconnect":
            request.transport.close()
            await asyncio.sleep(3600)
        if fault in ("truncated", "reset_mid_body", "trickle"):
            return await self.broken_body(request, fault)
        raise ValueError(f"unknown fault {fault!r}")

    async def broken_body(self, request: web.Request, fault: str) -> web.StreamResponse:
        """A 200 whose body announces its length and never arrives whole."""
        body = b'{"id": "cmpl-fake", "object": "text_completion", "choices": [{"index": 0, "text": ""}]}'
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        if fault == "trickle":
            for byte in body[:-1]:
                await resp.write(bytes([byte]))
                await asyncio.sleep(0.2)
            await asyncio.sleep(3600)
        await resp.write(body[: len(body) // 2])
        if fault == "truncated":
            await resp.write_eof()  # aiohttp ends the message short of Content-Length
        request.transport.close()
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.stats["generate"] += 1
        self.payloads.append(body)
        fault = await self.maybe_fault(request)
        if fault is not None:
            return fault
        prompt = body["prompt"]
        out, finish = await self.generate_tokens(prompt, body["max_tokens"])
        n0 = len(prompt)
        choice = {
            "index": 0,
            "text": "",
            "finish_reason": finish,
            "token_ids": out,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in out],
                "token_logprobs": [logprob_at(n0 + i) for i in range(len(out))],
                "top_logprobs": [],
                "text_offset": [],
            },
        }
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = list(prompt)
        if "routed_experts_prompt_start" in body and out:  # as if started with routes; vLLM's .npy in base64
            start = body.get("routed_experts_prompt_start", 0)
            routes = np.array([routed_at(p) for p in range(start, n0 - 1 + len(out))], dtype=np.int32)
            buffer = io.BytesIO()
            np.save(buffer, routes.reshape(len(routes), 2, 2), allow_pickle=False)
            choice["routed_experts"] = base64.b64encode(buffer.getvalue()).decode()
        reply = {"id": "cmpl-fake", "object": "text_completion", "choices": [choice]}
        if self.corrupt_next is not None:
            CORRUPTIONS[self.corrupt_next](reply, body["max_tokens"])
            self.corrupt_next = None
        return web.json_response(reply)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.stats["generate"] += 1
        self.payloads.append(body)
        fault = await self.maybe_fault(request)
        if fault is not None:
            return fault
        prompt = body["input_ids"]
        sampling = body.get("sampling_params", {})
        out, finish = await self.generate_tokens(prompt, sampling.get("max_new_tokens", 128))
        n0 = len(prompt)
        reason = {
            "stop": {"type": "stop", "matched": EOS},
            "length": {"type": "length", "length": len(out)},
            "abort": {"type": "abort", "message": "Abort before prefill"},
        }[finish]
        meta = {
            "id": "fake",
            "finish_reason": reason,
            "prompt_tokens": n0,
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "e2e_latency": 0.01,
            "output_token_logprobs": [[logprob_at(n0 + i), t, None] for i, t in enumerate(out)],
        }
        if body.get("return_routed_experts"):  # SGLang's encoding: base64 of int32 [positions, layers, top-k]
            start = body.get("routed_experts_start_len", 0)
            positions = range(start, n0 - 1 + len(out))  # every forward from start (the last token: none)
            meta["routed_experts"] = base64.b64encode(
                np.array([routed_at(p) for p in positions], dtype=np.int32).tobytes()
            ).decode()
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    async def pause(self, request: web.Request) -> web.Response:
        self.stats["pause"] += 1
        self.resumed.clear()
        if self.dialect == "sglang":
            return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.stats["resume"] += 1
        self.resumed.set()
        return web.json_response({"status": "resumed"})

    async def sleep(self, request: web.Request) -> web.Response:
        """vLLM's ``/sleep?level=1&mode=abort`` (the scheduler pauses, aborting requests, then memory goes) or
        SGLang's ``/release_memory_occupation`` (only while generation is paused, as SGLang requires)."""
        self.stats["sleep"] += 1
        if self.dialect == "vllm":
            if request.query.get("level") != "1" or request.query.get("mode") != "abort":
                return web.json_response({"error": f"unexpected query {dict(request.query)}"}, status=400)
            self.resumed.clear()
            self.sleeping = True
            return web.json_response({"status": "sleeping", "level": 1})
        if self.resumed.is_set():
            return web.json_response({"error": "release_memory_occupation while generating"}, status=400)
        self.sleeping = True
        return web.json_response({"success": True, "message": ""})

    async def wake(self, request: web.Request) -> web.Response:
        """vLLM's ``/wake_up`` (every tag: scheduling resumes too) or SGLang's ``/resume_memory_occupation``."""
        self.stats["wake"] += 1
        self.sleeping = False
        if self.dialect == "vllm":
            self.resumed.set()
            return web.json_response({"status": "awake", "tags": None})
        return web.json_response({"success": True, "message": ""})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.stats["flush_cache"] += 1
        return web.Response(text="Cache flushed.\n")  # SGLang answers in plain text

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def set_faults(self, request: web.Request) -> web.Response:
        self.faults.extend((await request.json())["faults"])
        return web.json_response({"queued": len(self.faults)})

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                **self.stats,
                "paused": not self.resumed.is_set(),
                "sleeping": self.sleeping,
                "payloads": list(self.payloads)[-5:],  # a list, or a bounded deque (tests/scale/sim_host.py)
            }
        )

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._count_calls])
        app.router.add_get("/health", self.health)
        app.router.add_post("/_faults", self.set_faults)
        app.router.add_get("/_stats", self.get_stats)
        if self.dialect == "vllm":
            app.router.add_post("/v1/completions", self.completions)
            app.router.add_post("/pause", self.pause)
            app.router.add_post("/resume", self.resume)
            app.router.add_post("/sleep", self.sleep)
            app.router.add_post("/wake_up", self.wake)
        else:
            app.router.add_post("/generate", self.generate)
            app.router.add_post("/pause_generation", self.pause)
            app.router.add_post("/continue_generation", self.resume)
            app.router.add_post("/flush_cache", self.flush_cache)
            app.router.add_post("/release_memory_occupation", self.sleep)
            app.router.add_post("/resume_memory_occupation", self.wake)
        return app

    @web.middleware
    async def _count_calls(self, request: web.Request, handler):
        """``stats["calls /route"]``: the requests to each route but generation, health and the test's own."""
        if request.path not in _UNCOUNTED:
            self.stats[f"calls {request.path}"] += 1
        return await handler(request)


_UNCOUNTED = {"/health", "/_faults", "/_stats", "/v1/completions", "/generate", "/v1/models", "/_host", "/_host/fault"}
"""Routes whose calls ``stats`` does not count (generation, health, the tests' own)."""


async def serve_update_route(request: web.Request, steps) -> web.StreamResponse:
    """megarl's one-call update route (``megarl.serving.vllm_route``) on an aiohttp test server, doing ``steps``
    (a ``megarl.serving.vllm_route.UpdateSteps``): the same request checks and reply lines as in a vLLM server."""
    from megarl.serving.vllm_route import update_lines, update_request

    try:
        mode, path, version, resume = update_request(await request.json())
    except ValueError as e:
        return web.json_response({"error": str(e)}, status=400)
    reply = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await reply.prepare(request)
    try:
        async for line in update_lines(steps, mode, path, version, resume):
            await reply.write(json.dumps(line).encode() + b"\n")
        await reply.write_eof()
    except ConnectionResetError:  # the trainer gave up on this server (its deadline passed)
        pass
    return reply


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dialect", choices=["vllm", "sglang"], default="vllm")
    parser.add_argument("--token-delay", type=float, default=0.005)
    parser.add_argument("--eos-every", type=int, default=0)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--delay-rate", type=float, default=0.0)
    parser.add_argument("--max-delay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    server = FakeServer(
        args.dialect, args.token_delay, args.eos_every, args.fail_rate, args.delay_rate, args.max_delay, args.seed
    )
    web.run_app(server.app(), host="127.0.0.1", port=args.port, print=None, access_log=None, shutdown_timeout=0.2)
    print("fake server: shut down", flush=True)  # like a real server's shutdown chatter


if __name__ == "__main__":
    main()
