"""The OpenAI protocol of the proxy: what a request may ask, checked; OpenAI-shaped errors; chat
messages in the chat template's form; tool calls parsed from the model's text.

Nothing here holds state: :mod:`~megarl.workflow.openai_proxy.session` samples and records the
calls, :mod:`~megarl.workflow.openai_proxy.server` answers HTTP.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

from aiohttp import web

from megarl.utils import stats_tracker

MODEL_NAME = "megarl-policy"
"""The model ``GET /v1/models`` lists; requests may name any model."""
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CHAT_PARAMS = {
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
"""The ``chat/completions`` parameters the proxy reads (any other must be null, false, 0 or empty)."""
COMPLETION_PARAMS = {"prompt", "model", "max_tokens", "temperature", "top_p", "stop", "user"}
"""The ``completions`` parameters the proxy reads."""
_NEUTRAL = {"n": 1, "best_of": 1}  # neutral values other than null / false / 0 / empty
_WHY_NOT = {
    "stream": "streaming is not supported: call without stream=True",
    "n": "one choice per request: call again for more samples (each call is recorded)",
}
STOP_REASONS = ("stop", "length")
"""The stop reasons of a finished generation (any other: the engine went away)."""


class ProxyError(Exception):
    """A request answered with an OpenAI-shaped error (``{"error": {message, type, param, code}}``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> web.Response:
        """The HTTP answer: the status and the OpenAI-shaped error body."""
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        error = {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        return web.json_response({"error": error}, status=self.status)


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


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def tools_key(tools: list[dict] | None) -> str:
    """A request's tools as canonical JSON (empty without tools): a chat continues only a call with the same."""
    return json.dumps(tools, sort_keys=True) if tools else ""


# ------------------------------------------------------------------ request checks


def check_params(body: dict[str, Any], supported: set[str]) -> None:
    """A 400 naming the first parameter outside ``supported`` set to a non-neutral value."""
    for name, value in body.items():
        neutral = value in (None, False, 0, "", [], {}) or value == _NEUTRAL.get(name, object())
        if name not in supported and not neutral:
            why = _WHY_NOT.get(name, "megarl's proxy does not support it")
            raise ProxyError(400, f"unsupported parameter {name}={value!r}: {why}", name)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat request's ``messages`` (a 400 when they, or its ``tools``, are malformed)."""
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


def tool_choice_of(body: dict[str, Any]) -> str:
    """``"auto"`` or ``"none"``; a forced tool choice is a 400."""
    choice = body.get("tool_choice") or "auto"
    if choice not in ("auto", "none"):
        raise ProxyError(
            400,
            f"tool_choice={choice!r} is not supported: only 'auto' or 'none' (the proxy cannot force a call)",
            "tool_choice",
        )
    return choice


def require_equal(body: dict[str, Any], name: str, value: float) -> None:
    """A 400 when the request sets ``name`` to another value than the workflow's ``gconfig``."""
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


def max_tokens_of(body: dict[str, Any]) -> float:
    """The request's token budget (``max_tokens`` or ``max_completion_tokens``); inf when it sets none."""
    given = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if len(given) == 2:
        raise ProxyError(400, "set max_tokens or max_completion_tokens, not both", "max_tokens")
    if not given:
        return math.inf
    value = body[given[0]]
    if type(value) is not int or value < 1:
        raise ProxyError(400, f"{given[0]} must be a positive integer, got {value!r}", given[0])
    return value


def stop_strings(body: dict[str, Any]) -> list[str]:
    """The request's ``stop`` strings, as a list."""
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ProxyError(400, f"stop must be a string or a list of strings, got {stop!r}", "stop")
    return stops
