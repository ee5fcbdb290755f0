"""An OpenAI-compatible proxy in front of ``engine.agenerate``, for agent code (AReaL's proxy).

An agent written against the ``openai`` client (:mod:`megarl.workflow.openai_agent`) makes
its LLM calls through this aiohttp server on 127.0.0.1, on an ephemeral port. Each agent run
is a *session*: its ``base_url`` is ``http://127.0.0.1:PORT/s/<session>/v1`` and its
``api_key`` is ``<session>``; either names the session (``/v1/...`` with
``Authorization: Bearer <session>`` is how AReaL's proxy tells sessions apart). Routes, not
streaming: ``POST chat/completions``, ``POST completions``, ``GET models``.

What a request may ask, and why:

* ``temperature``, ``top_p``: omitted, or equal to the workflow's ``gconfig``. The trainer
  scores the sampled tokens at ``gconfig``'s temperature; a call sampled at another would
  carry behaviour logprobs of another distribution. Sampling follows ``gconfig`` (greedy
  for evaluation, whatever the agent asks).
* ``max_tokens`` / ``max_completion_tokens``: an upper bound, lowered to
  ``gconfig.max_new_tokens`` and to what the context length leaves. A prompt that fills the
  context is a 400 with code ``context_length_exceeded``, which an agent may catch to stop.
* ``stop`` adds to ``gconfig.stop``. ``tools`` are rendered by the chat template, and Hermes /
  Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the output come
  back as ``tool_calls`` with ``finish_reason: "tool_calls"`` (not with ``tool_choice: "none"``).
* ``stream: true``, ``n > 1``, a forced ``tool_choice`` and any other parameter set to a
  non-neutral value (not null, false, 0 or empty) are a 400 naming the parameter.

Token in, token out: a chat request whose messages extend an earlier call of its session
(that call's messages, then the assistant message it returned, unchanged but for JSON
form) continues that call's ids: its prompt and output ids, an EOS token if the output did
not end with one, then the chat template's ids of the new messages
(:func:`~megarl.workflow.chat.next_turn_ids`). What the model wrote is never encoded again,
so the conversation trains exactly the sampled ids. A text completion whose prompt extends
an earlier prompt + completion continues its ids the same way (the new text encoded alone);
a token-id prompt is used as given.

Errors: a malformed request is a 4xx whose OpenAI-shaped body names what was wrong. Any
other failure (the inference engine's) is a 500 and fails the session, so the episode fails
even when the agent catches the error: no run that lost a call is trained on.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from megarl.api.engine_api import GenerationEngine
from megarl.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from megarl.utils import stats_tracker
from megarl.workflow.chat import end_turn, next_turn_ids, render_chat_ids

logger = logging.getLogger(__name__)

MODEL_NAME = "megarl-policy"
"""The model ``GET /v1/models`` lists; requests may name any model."""
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_CHAT_PARAMS = {
    "messages",
    "model",
    "tools",
    "tool_choice",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "user",
    "metadata",
    "store",
    "parallel_tool_calls",
}
_COMPLETION_PARAMS = {"prompt", "model", "max_tokens", "temperature", "top_p", "stop", "user"}
_NEUTRAL = {"n": 1, "best_of": 1}  # neutral values other than null / false / 0 / empty
_WHY_NOT = {
    "stream": "streaming is not supported: call without stream=True",
    "n": "one choice per request: call again for more samples (each call is recorded)",
}
_STOP_REASONS = ("stop", "length")


class ProxyError(Exception):
    """A request answered with an OpenAI-shaped error (``{"error": {message, type, param, code}}``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> web.Response:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        error = {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        return web.json_response({"error": error}, status=self.status)


@dataclass
class CallRecord:
    """One LLM call of a session, as sampled."""

    id: str
    """The completion id the agent got back (the key of a reward dict)."""
    kind: str
    """``"chat"``, ``"text"`` (a text prompt) or ``"tokens"`` (a token-id prompt); calls continue their own kind."""
    conversation: list | str
    """What a call continuing this one starts with: the messages and the returned message
    (:func:`canonical_message`), the prompt and the completion text, or the prompt and output ids."""
    response: ModelResponse
    """Prompt and output ids, logprobs, versions and stop reason."""
    tools: str = ""
    """The request's tools as canonical JSON: a chat continues only a call with the same tools."""
    parent: CallRecord | None = None
    """The earlier call this one continues, if any."""

    def chain(self) -> list[CallRecord]:
        """The calls of this call's conversation, first to this one."""
        calls = [self]
        while calls[-1].parent is not None:
            calls.append(calls[-1].parent)
        return calls[::-1]


@dataclass
class ProxySession:
    """One agent run: how its calls are sampled, where they go, and what they produced."""

    engine: GenerationEngine
    """Generates every call (``agenerate``)."""
    tokenizer: Any
    """Chat template, encoding of text prompts, decoding of outputs."""
    gconfig: GenerationHyperparameters
    """Sampling of every call (see the module docstring for what a request may change)."""
    index: int = 0
    """The run's index among its episode's runs (with ``gconfig.seed``: its seed)."""
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Routing key of the calls: an episode's runs share a server and its prefix cache."""
    max_context_len: int | None = None
    """The servers' context length (prompt + output); None: unbounded."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """The session's name in its base_url and api_key."""
    calls: list[CallRecord] = field(default_factory=list)
    """Every finished call, in the order they finished."""
    error: BaseException | None = None
    """The first failure of a call (not a bad request): the run must not be trained on."""
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    """The episode's context (stats scope, workflow context), in which its calls run."""

    def _continued(self, kind: str, conversation: list | str, tools: str = "") -> CallRecord | None:
        """The call whose conversation ``conversation`` extends, the longest (then the latest) one."""
        best = None
        for call in self.calls:
            n = len(call.conversation)
            if call.kind == kind and call.tools == tools and conversation[:n] == call.conversation:
                best = call if best is None or n >= len(best.conversation) else best
        return best

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None) -> tuple[CallRecord | None, list[int]]:
        """The call ``messages`` continue (or None) and the prompt ids."""
        parent = self._continued("chat", [canonical_message(m) for m in messages], _tools_key(tools))
        try:
            if parent is None:
                return None, render_chat_ids(self.tokenizer, _for_template(messages), tools, add_generation_prompt=True)
            new = _for_template(messages[len(parent.conversation) :])
            return parent, _ids_of(parent, self.tokenizer.eos_token_id) + next_turn_ids(self.tokenizer, new, tools)
        except Exception as e:  # the template rejected the agent's messages
            raise ProxyError(400, f"the chat template cannot render these messages: {e}", "messages") from e

    def text_prompt(self, prompt: Any) -> tuple[str, CallRecord | None, list[int]]:
        """The kind of a completions ``prompt``, the call it continues (or None) and the prompt ids."""
        if isinstance(prompt, str) and prompt:
            parent = self._continued("text", prompt)
            if parent is None:
                return "text", None, list(self.tokenizer.encode(prompt))
            rest = self.tokenizer.encode(prompt[len(parent.conversation) :], add_special_tokens=False)
            return "text", parent, _ids_of(parent) + list(rest)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return "tokens", self._continued("tokens", prompt), list(prompt)
        raise ProxyError(
            400, "prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt"
        )

    def sampling(self, body: dict[str, Any], prompt_ids: list[int]) -> GenerationHyperparameters:
        """``gconfig`` for this call: its seed, the request's token budget and stop strings."""
        g = self.gconfig
        _require_equal(body, "temperature", g.temperature)
        _require_equal(body, "top_p", g.top_p)
        budget = min(_max_tokens(body), g.max_new_tokens)
        if self.max_context_len is not None:
            room = self.max_context_len - len(prompt_ids)
            if room < 1:
                raise ProxyError(
                    400,
                    f"the prompt is {len(prompt_ids)} tokens; the context length is {self.max_context_len}",
                    "messages",
                    "context_length_exceeded",
                )
            budget = min(budget, room)
        return g.for_sample(prompt_ids, self.index).new(
            max_new_tokens=budget, min_new_tokens=min(g.min_new_tokens, budget), stop=[*g.stop, *_stop(body)]
        )

    async def generate(self, prompt_ids: list[int], body: dict[str, Any]) -> ModelResponse:
        """One call on the engine; a failure is the session's (the caller records it)."""
        if self.error is not None:
            raise ProxyError(500, f"an earlier call of this agent run failed ({self.error!r}); the episode fails")
        gconfig = self.sampling(body, prompt_ids)
        req = ModelRequest(rid=self.rid, input_ids=prompt_ids, gconfig=gconfig, tokenizer=self.tokenizer)
        resp = await self.engine.agenerate(req)
        resp.check_aligned()
        if resp.stop_reason not in _STOP_REASONS:
            raise RuntimeError(f"generation ended with stop_reason {resp.stop_reason!r} (the engine was destroyed?)")
        return resp

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


async def chat_completion(session: ProxySession, body: dict[str, Any]) -> dict[str, Any]:
    """Answer a ``chat/completions`` request and record the call."""
    _check_params(body, _CHAT_PARAMS)
    messages = _messages(body)
    tools = body.get("tools") or None
    parse_tools = _tool_choice(body) != "none" and tools is not None
    parent, prompt_ids = session.chat_prompt(messages, tools)
    resp = await session.generate(prompt_ids, body)
    text = session.decode(resp.output_tokens)
    content, tool_calls = parse_tool_calls(text) if parse_tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    conversation = [canonical_message(m) for m in [*messages, message]]
    call = CallRecord(f"chatcmpl-{uuid.uuid4().hex}", "chat", conversation, resp, _tools_key(tools), parent)
    session.calls.append(call)
    finish = "tool_calls" if tool_calls and resp.stop_reason == "stop" else resp.stop_reason
    return _reply(call, "chat.completion", body, {"message": message, "finish_reason": finish})


async def text_completion(session: ProxySession, body: dict[str, Any]) -> dict[str, Any]:
    """Answer a ``completions`` request and record the call."""
    _check_params(body, _COMPLETION_PARAMS)
    kind, parent, prompt_ids = session.text_prompt(body.get("prompt"))
    resp = await session.generate(prompt_ids, body)
    text = session.decode(resp.output_tokens)
    conversation = body["prompt"] + text if kind == "text" else resp.input_tokens + resp.output_tokens
    call = CallRecord(f"cmpl-{uuid.uuid4().hex}", kind, conversation, resp, parent=parent)
    session.calls.append(call)
    return _reply(call, "text_completion", body, {"text": text, "finish_reason": resp.stop_reason})


def _reply(call: CallRecord, kind: str, body: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
    resp = call.response
    return {
        "id": call.id,
        "object": kind,
        "created": int(time.time()),
        "model": body.get("model") or MODEL_NAME,
        "choices": [{"index": 0, "logprobs": None, **choice}],
        "usage": {
            "prompt_tokens": resp.input_len,
            "completion_tokens": resp.output_len,
            "total_tokens": resp.input_len + resp.output_len,
        },
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of ``text``.

    Returns the text outside the blocks (None when empty, as OpenAI does) and OpenAI
    ``tool_calls``. A malformed block leaves the whole text as content, with no calls: the
    agent sees what the model wrote (counted in ``tool_call_malformed``).
    """
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls = [_tool_call(block) for block in blocks]
    stats_tracker.scalar(tool_call_malformed=float(None in calls))
    if None in calls:
        return text, []
    return _TOOL_CALL.sub("", text).strip() or None, calls


def _tool_call(block: str) -> dict[str, Any] | None:
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
    function = {"name": call["name"], "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def canonical_message(message: dict[str, Any]) -> dict[str, Any]:
    """What the chat template renders of a message, in one form: a returned message matches
    itself however the agent passes it back (a dict, the SDK object's dump with its nulls, text parts)."""
    out = {"role": message.get("role"), "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"name": f.get("name"), "arguments": _json_or_str(f.get("arguments"))}
            for f in (_function(c) for c in message["tool_calls"])
        ]
    out.update({k: message[k] for k in ("name", "tool_call_id") if message.get(k) is not None})
    return out


def _for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as HF chat templates expect them: no nulls, text content, tool-call arguments as objects."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        message["content"] = _text(message.get("content"))
        if message.get("tool_calls"):
            message["tool_calls"] = [_template_tool_call(c) for c in message["tool_calls"]]
        out.append(message)
    return out


def _template_tool_call(tool_call: Any) -> dict[str, Any]:
    function = _function(tool_call)
    function = {**function, "arguments": _json_or_str(function.get("arguments"))}
    return {"type": "function", "id": tool_call.get("id"), "function": function}


def _function(tool_call: Any) -> dict[str, Any]:
    return (tool_call.get("function") or {}) if isinstance(tool_call, dict) else {}


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _json_or_str(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


def _ids_of(call: CallRecord, eos_token_id: int | None = None) -> list[int]:
    """A call's prompt and output ids; with ``eos_token_id``, ended as a chat turn (:func:`end_turn`)."""
    ids = call.response.input_tokens + call.response.output_tokens
    return end_turn(ids, eos_token_id) if eos_token_id is not None else ids


# ------------------------------------------------------------------ request checks


def _check_params(body: dict[str, Any], supported: set[str]) -> None:
    for name, value in body.items():
        neutral = value in (None, False, 0, "", [], {}) or value == _NEUTRAL.get(name, object())
        if name not in supported and not neutral:
            why = _WHY_NOT.get(name, "megarl's proxy does not support it")
            raise ProxyError(400, f"unsupported parameter {name}={value!r}: {why}", name)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise ProxyError(400, "messages must be a non-empty list of {'role': ..., 'content': ...} objects", "messages")
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise ProxyError(400, "tools must be a list of tool definitions", "tools")
    return messages


def _tool_choice(body: dict[str, Any]) -> str:
    choice = body.get("tool_choice") or "auto"
    if choice not in ("auto", "none"):
        raise ProxyError(
            400,
            f"tool_choice={choice!r} is not supported: only 'auto' or 'none' (the proxy cannot force a call)",
            "tool_choice",
        )
    return choice


def _require_equal(body: dict[str, Any], name: str, value: float) -> None:
    given = body.get(name)
    if given is None:
        return
    if isinstance(given, bool) or not isinstance(given, int | float) or not math.isclose(given, value, rel_tol=1e-6):
        raise ProxyError(
            400,
            f"{name}={given!r} differs from the workflow's gconfig.{name}={value}: the trainer "
            f"scores the tokens as sampled with gconfig's; omit {name} or set it to {value}",
            name,
        )


def _max_tokens(body: dict[str, Any]) -> float:
    given = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if len(given) == 2:
        raise ProxyError(400, "set max_tokens or max_completion_tokens, not both", "max_tokens")
    if not given:
        return math.inf
    value = body[given[0]]
    if type(value) is not int or value < 1:
        raise ProxyError(400, f"{given[0]} must be a positive integer, got {value!r}", given[0])
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ProxyError(400, f"stop must be a string or a list of strings, got {stop!r}", "stop")
    return stops


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


# ------------------------------------------------------------------ the server


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

        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
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
        other than a bad request fails the session."""
        session = self._session_of(request)
        body = await _json_body(request)
        task = asyncio.get_running_loop().create_task(answer(session, body), context=session.context)
        try:
            return web.json_response(await task)
        except ProxyError:
            raise
        except Exception as e:  # reported to the agent, and it fails the episode
            session.error = session.error or e
            logger.warning("agent session %s: a call failed: %r", session.id, e)
            raise ProxyError(500, f"the call failed: {type(e).__name__}: {e}") from e


async def _models(request: web.Request) -> web.Response:
    model = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "megarl"}
    return web.json_response({"object": "list", "data": [model]})
