"""An agent run's session on the proxy: its calls' prompt ids (continuing earlier calls' ids), their
sampling, the engine call, and the record of what each call produced (see :mod:`megarl.workflow.openai_proxy`).
"""

from __future__ import annotations

import bisect
import contextvars
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from megarl.api.engine_api import GenerationEngine
from megarl.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from megarl.workflow.chat import end_turn, next_turn_ids, render_chat_ids
from megarl.workflow.openai_proxy.protocol import (
    CHAT_PARAMS,
    COMPLETION_PARAMS,
    MODEL_NAME,
    STOP_REASONS,
    ProxyError,
    canonical_message,
    chat_messages,
    check_params,
    for_template,
    max_tokens_of,
    parse_tool_calls,
    require_equal,
    stop_strings,
    tool_choice_of,
    tools_key,
)


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
    ordinal: int = 0
    """The call's number in its session, counted as the calls start (its seed; the last call is the last started)."""

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
    """Sampling of every call (what a request may change: :mod:`megarl.workflow.openai_proxy`)."""
    index: int = 0
    """The run's index among its episode's runs (with ``gconfig.seed``: its calls' seeds)."""
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Routing key of the calls: an episode's runs share a server and its prefix cache."""
    max_context_len: int | None = None
    """The servers' context length (prompt + output); None: unbounded."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """The session's name in its base_url and api_key."""
    calls: list[CallRecord] = field(default_factory=list)
    """Every finished call, in the order they started (as in AReaL, the last call is the last started)."""
    started: int = 0
    """Calls started on the engine so far: the next call's ordinal."""
    context_refusals: int = 0
    """Calls refused because their prompt filled the context (``context_length_exceeded``)."""
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
        parent = self._continued("chat", [canonical_message(m) for m in messages], tools_key(tools))
        try:
            if parent is None:
                return None, render_chat_ids(self.tokenizer, for_template(messages), tools, add_generation_prompt=True)
            new = for_template(messages[len(parent.conversation) :])
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

    def sampling(self, body: dict[str, Any], prompt_ids: list[int], ordinal: int = 0) -> GenerationHyperparameters:
        """``gconfig`` for call ``ordinal``: its seed, the request's token budget and stop strings.

        With ``gconfig.seed``, each call of each run draws its own seed, the same in every run of the
        trainer: sample ``index + ordinal * n_samples`` of its prompt (a call repeated draws anew).
        """
        g = self.gconfig
        require_equal(body, "temperature", g.temperature)
        require_equal(body, "top_p", g.top_p)
        budget = min(max_tokens_of(body), g.max_new_tokens)
        if self.max_context_len is not None:
            room = self.max_context_len - len(prompt_ids)
            if room < 1:
                self.context_refusals += 1
                raise ProxyError(
                    400,
                    f"the prompt is {len(prompt_ids)} tokens; the context length is {self.max_context_len}",
                    "messages",
                    "context_length_exceeded",
                )
            budget = min(budget, room)
        return g.for_sample(prompt_ids, self.index + ordinal * g.n_samples).new(
            max_new_tokens=budget, min_new_tokens=min(g.min_new_tokens, budget), stop=[*g.stop, *stop_strings(body)]
        )

    async def generate(self, prompt_ids: list[int], body: dict[str, Any]) -> tuple[int, ModelResponse]:
        """One call on the engine: its ordinal and response; a failure is the session's (the caller records it)."""
        if self.error is not None:
            raise ProxyError(500, f"an earlier call of this agent run failed ({self.error!r}); the episode fails")
        ordinal = self.started
        gconfig = self.sampling(body, prompt_ids, ordinal)
        self.started += 1
        req = ModelRequest(rid=self.rid, input_ids=prompt_ids, gconfig=gconfig, tokenizer=self.tokenizer)
        resp = await self.engine.agenerate(req)
        resp.check_aligned()
        if resp.stop_reason not in STOP_REASONS:
            raise RuntimeError(f"generation ended with stop_reason {resp.stop_reason!r} (the engine was destroyed?)")
        return ordinal, resp

    def record(self, call: CallRecord) -> None:
        """Keep a finished call, among the others in the order they started."""
        bisect.insort(self.calls, call, key=lambda c: c.ordinal)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


async def chat_completion(session: ProxySession, body: dict[str, Any]) -> dict[str, Any]:
    """Answer a ``chat/completions`` request and record the call."""
    check_params(body, CHAT_PARAMS)
    messages = chat_messages(body)
    tools = body.get("tools") or None
    parse_tools = tool_choice_of(body) != "none" and tools is not None
    parent, prompt_ids = session.chat_prompt(messages, tools)
    ordinal, resp = await session.generate(prompt_ids, body)
    text = session.decode(resp.output_tokens)
    content, tool_calls = parse_tool_calls(text) if parse_tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    conversation = [canonical_message(m) for m in [*messages, message]]
    call = CallRecord(f"chatcmpl-{uuid.uuid4().hex}", "chat", conversation, resp, tools_key(tools), parent, ordinal)
    session.record(call)
    finish = "tool_calls" if tool_calls and resp.stop_reason == "stop" else resp.stop_reason
    return _reply(call, "chat.completion", body, {"message": message, "finish_reason": finish})


async def text_completion(session: ProxySession, body: dict[str, Any]) -> dict[str, Any]:
    """Answer a ``completions`` request and record the call."""
    check_params(body, COMPLETION_PARAMS)
    kind, parent, prompt_ids = session.text_prompt(body.get("prompt"))
    ordinal, resp = await session.generate(prompt_ids, body)
    text = session.decode(resp.output_tokens)
    conversation = body["prompt"] + text if kind == "text" else resp.input_tokens + resp.output_tokens
    call = CallRecord(f"cmpl-{uuid.uuid4().hex}", kind, conversation, resp, parent=parent, ordinal=ordinal)
    session.record(call)
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


def _ids_of(call: CallRecord, eos_token_id: int | None = None) -> list[int]:
    """A call's prompt and output ids; with ``eos_token_id``, ended as a chat turn (:func:`end_turn`)."""
    ids = call.response.input_tokens + call.response.output_tokens
    return end_turn(ids, eos_token_id) if eos_token_id is not None else ids
