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
  for evaluation, whatever the agent asks). With ``gconfig.seed``, each call of a session
  draws its own seed (the same messages asked again give another sample), the same in every run.
* ``max_tokens`` / ``max_completion_tokens``: an upper bound, lowered to
  ``gconfig.max_new_tokens`` and to what the context length leaves. A prompt that fills the
  context is a 400 with code ``context_length_exceeded``, which an agent may catch to stop
  (a run whose every call is refused so rejects its episode).
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
even when the agent catches the error: no run that lost a call is trained on. A call whose
client hangs up (the agent's timeout) is cancelled and not recorded: it is not trained on.

Its parts: :mod:`~megarl.workflow.openai_proxy.protocol` (what a request may ask, checked; errors,
messages and tool calls in OpenAI's shapes), :mod:`~megarl.workflow.openai_proxy.session` (an agent
run's calls: prompt ids, sampling, the engine call, their record) and
:mod:`~megarl.workflow.openai_proxy.server` (the aiohttp server, up while a session is open).
"""

from __future__ import annotations

from megarl.workflow.openai_proxy.protocol import MODEL_NAME, ProxyError, canonical_message, parse_tool_calls
from megarl.workflow.openai_proxy.server import OpenAIProxy
from megarl.workflow.openai_proxy.session import CallRecord, ProxySession, chat_completion, text_completion

__all__ = [
    "MODEL_NAME",
    "CallRecord",
    "OpenAIProxy",
    "ProxyError",
    "ProxySession",
    "canonical_message",
    "chat_completion",
    "parse_tool_calls",
    "text_completion",
]
