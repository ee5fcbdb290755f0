"""The proxy's aiohttp server: up while an agent run's session is open, routing each call to its
session (by base_url or api_key) and answering failures in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from megarl.workflow.openai_proxy.protocol import MODEL_NAME, ProxyError
from megarl.workflow.openai_proxy.session import ProxySession, chat_completion, text_completion

logger = logging.getLogger("megarl.workflow.openai_proxy")


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise ProxyError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ProxyError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


@web.middleware
async def _openai_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        return await handler(request)
    except ProxyError as e:
        return e.response()
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method
        if e.status < 400:
            raise
        return ProxyError(e.status, f"{request.method} {request.path}: {e.reason}").response()


@dataclass
class _Server:
    """A running proxy server and the HTTP client its agents share."""

    runner: web.AppRunner
    url: str
    http_client: Any
    """An ``httpx.AsyncClient`` for the agents' ``AsyncOpenAI`` (one per run costs ~50 ms, AReaL found);
    it ignores proxy environment variables, which must not route 127.0.0.1."""
    loop: asyncio.AbstractEventLoop
    users: int = 0
    """Open sessions."""
    stopped: bool = False

    @classmethod
    async def start(cls, app: web.Application, host: str) -> _Server:
        import httpx

        # handler_cancellation: a client that hangs up (its timeout) cancels its call's handler (see _post)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, host, 0).start()
        host, port = runner.addresses[0][:2]
        client = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=1000))
        return cls(runner, f"http://{host}:{port}", client, asyncio.get_running_loop())

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self.http_client.aclose()
            await self.runner.cleanup()


class OpenAIProxy:
    """The proxy server of a workflow: up while sessions are open, on ``host`` and a free port.

    It starts with the first session on the episodes' event loop and stops when the last
    one ends. An idle proxy holds no port, and a workflow built per submitted item (a class
    passed to ``submit``) leaves none behind. Between synchronous training steps it starts
    again on a new port (each run learns its base_url when it starts), in ~40 ms on a 2-core
    CPU, mostly the agents' HTTP client loading its TLS certificates.
    """

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self._sessions: dict[str, ProxySession] = {}
        self._server: _Server | None = None
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    @asynccontextmanager
    async def serve(self, session: ProxySession) -> AsyncIterator[dict[str, Any]]:
        """Serve ``session`` for the block. Yields the agent's ``extra_kwargs`` (AReaL's names):
        ``base_url``, ``api_key`` and ``http_client``."""
        server = await self._acquire()
        self._sessions[session.id] = session
        try:
            base_url = f"{server.url}/s/{session.id}/v1"
            yield {"base_url": base_url, "api_key": session.id, "http_client": server.http_client}
        finally:
            del self._sessions[session.id]
            await self._release(server)

    @property
    def url(self) -> str | None:
        """``http://host:port`` while serving, else None."""
        return None if self._server is None else self._server.url

    def close(self) -> None:
        """Stop the server if a session is still open (its episode was abandoned); idempotent."""
        server, self._server = self._server, None
        if server is None or server.loop.is_closed():
            return
        if server.loop.is_running():  # the rollout pool's loop, in its own thread
            asyncio.run_coroutine_threadsafe(server.stop(), server.loop)
        else:
            server.loop.run_until_complete(server.stop())

    def _loop_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock_loop is not loop:  # an asyncio.Lock belongs to one loop
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    async def _acquire(self) -> _Server:
        async with self._loop_lock():
            if self._server is not None and self._server.loop.is_closed():
                self._server = None  # its loop ended without closing its sessions
            if self._server is None:
                self._server = await _Server.start(self._app(), self.host)
                logger.info("OpenAI-compatible proxy serving at %s", self._server.url)
            elif self._server.loop is not asyncio.get_running_loop():
                raise RuntimeError("the proxy already serves episodes of another event loop")
            self._server.users += 1
            return self._server

    async def _release(self, server: _Server) -> None:
        async with self._loop_lock():
            server.users -= 1
            if server.users == 0:
                if self._server is server:  # else close() let it go already
                    self._server = None
                await server.stop()

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[_openai_errors], client_max_size=64 * 2**20)
        for prefix in ("/s/{session}/v1", "/v1"):
            app.router.add_post(f"{prefix}/chat/completions", functools.partial(self._post, chat_completion))
            app.router.add_post(f"{prefix}/completions", functools.partial(self._post, text_completion))
            app.router.add_get(f"{prefix}/models", _models)
        return app

    def _session_of(self, request: web.Request) -> ProxySession:
        name = request.match_info.get("session")
        if name is None:
            auth = request.headers.get("Authorization", "")
            name = auth[len("bearer ") :].strip() if auth.lower().startswith("bearer ") else ""
            if not name:
                raise ProxyError(401, "no session: use the base_url or the api_key passed to the agent's run()")
        session = self._sessions.get(name)
        if session is None:
            raise ProxyError(
                404,
                f"no session {name!r}: a session lasts one agent run; use the base_url and api_key passed to its run()",
            )
        return session

    async def _post(self, answer: Callable[..., Awaitable[dict]], request: web.Request) -> web.Response:
        """Run ``answer(session, body)`` in the episode's context (its stats scope); a failure
        other than a bad request fails the session. A call whose client hung up (the agent gave up
        on it) is cancelled: its generation stops and it is not recorded, so it is not trained on."""
        session = self._session_of(request)
        body = await _json_body(request)
        task = asyncio.get_running_loop().create_task(answer(session, body), context=session.context)
        try:
            return web.json_response(await task)
        except asyncio.CancelledError:
            task.cancel()
            logger.info("agent session %s: a call was cancelled (its client hung up); it is not recorded", session.id)
            raise
        except ProxyError:
            raise
        except Exception as e:  # reported to the agent, and it fails the episode
            session.error = session.error or e
            logger.warning("agent session %s: a call failed: %r", session.id, e)
            raise ProxyError(500, f"the call failed: {type(e).__name__}: {e}") from e


async def _models(request: web.Request) -> web.Response:
    model = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "megarl"}
    return web.json_response({"object": "list", "data": [model]})
