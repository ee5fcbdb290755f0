"""A fault-injecting fake inference server (vLLM or SGLang dialect), run as its own process.

Only for fault injection and SGLang (which cannot serve here). Generation is
deterministic in the absolute position ``p`` of a token (prompt included)::

    token(p)   = EOS if eos_every and p % eos_every == 0 else (p * 31 + 7) % 1000 + 10
    logprob(p) = -((p % 10) + 1) / 10

so a generation that is interrupted and continued must produce exactly the tokens of an
uninterrupted one, which lets tests check that nothing is lost or duplicated.

Control endpoints (test only): ``POST /_faults {"faults": [...]}`` queues faults that
the next generate requests consume one each: ``"500"``, ``"malformed"`` (not JSON),
``"bad_shape"`` (JSON without the fields), ``"hang"`` (never answers),
``"disconnect"`` (drops the connection). ``GET /_stats`` reports counters.

Run: ``python tests/rollout/fake_server.py --port P --dialect vllm|sglang``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections

from aiohttp import web

EOS = 2


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
}
"""Fault names of corrupted complete replies, for ``POST /_faults``."""


class FakeServer:
    def __init__(self, dialect: str, token_delay: float, eos_every: int):
        self.dialect = dialect
        self.token_delay = token_delay
        self.eos_every = eos_every
        self.faults: collections.deque[str] = collections.deque()
        self.corrupt_next: str | None = None  # one of CORRUPTIONS, applied to the next complete reply
        self.resumed = asyncio.Event()
        self.resumed.set()
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
            token = token_at(len(prompt) + len(out), self.eos_every)
            out.append(token)
            if token == EOS:
                return out, "stop"
        return out, "length"

    async def maybe_fault(self, request: web.Request) -> web.StreamResponse | None:
        if not self.faults:
            return None
        fault = self.faults.popleft()
        self.stats[f"fault_{fault}"] += 1
        if fault in CORRUPTIONS:
            self.corrupt_next = fault
            return None
        if fault == "500":
            return web.Response(status=500, text="injected server error")
        if fault == "malformed":
            return web.Response(status=200, text="{not json", content_type="application/json")
        if fault == "bad_shape":
            return web.json_response({"unexpected": True})
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "disconnect":
            request.transport.close()
            await asyncio.sleep(3600)
        raise ValueError(f"unknown fault {fault!r}")

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

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.stats["flush_cache"] += 1
        return web.Response(text="Cache flushed.\n")  # SGLang answers in plain text

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def set_faults(self, request: web.Request) -> web.Response:
        self.faults.extend((await request.json())["faults"])
        return web.json_response({"queued": len(self.faults)})

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response({**self.stats, "paused": not self.resumed.is_set(), "payloads": self.payloads[-5:]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/_faults", self.set_faults)
        app.router.add_get("/_stats", self.get_stats)
        if self.dialect == "vllm":
            app.router.add_post("/v1/completions", self.completions)
            app.router.add_post("/pause", self.pause)
            app.router.add_post("/resume", self.resume)
        else:
            app.router.add_post("/generate", self.generate)
            app.router.add_post("/pause_generation", self.pause)
            app.router.add_post("/continue_generation", self.resume)
            app.router.add_post("/flush_cache", self.flush_cache)
        return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dialect", choices=["vllm", "sglang"], default="vllm")
    parser.add_argument("--token-delay", type=float, default=0.005)
    parser.add_argument("--eos-every", type=int, default=0)
    args = parser.parse_args()
    server = FakeServer(args.dialect, args.token_delay, args.eos_every)
    web.run_app(server.app(), host="127.0.0.1", port=args.port, print=None, access_log=None, shutdown_timeout=0.2)
    print("fake server: shut down", flush=True)  # like a real server's shutdown chatter


if __name__ == "__main__":
    main()
