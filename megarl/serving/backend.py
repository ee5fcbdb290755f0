"""The small interface behind which each inference server's HTTP dialect lives.

One implementation per file: :mod:`megarl.serving.vllm` and :mod:`megarl.serving.sglang`.
A backend only translates: a generation step into a request body and the reply into a
:class:`GenerationChunk`, and pause / resume into endpoint calls. Retries, routing and
continuation are the engine's.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from megarl.api.io_struct import GenerationHyperparameters
from megarl.api.trajectory import TOKEN_ID_LIMIT
from megarl.serving.http import MalformedResponseError

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class GenerationChunk:
    """What one ``/generate``-style call produced (possibly cut short by a pause).

    A backend's parser hands over the values as the reply spelled them; :func:`check_chunk` checks
    them (a null logprob, a token id outside the vocabulary, ...) and names the reply's field of a bad one.
    """

    output_tokens: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    routed_experts: list[list[int]] | None = None
    """MoE, when asked for: per output token, every layer's top-k experts (layer-major) of the forward
    that produced it."""
    prompt_routed_experts: list[list[int]] | None = None
    """MoE, when asked for: the same for the request's input tokens after the first (the forward at
    input position ``p`` routed, and produced, input token ``p + 1``)."""
    token_field: str = "output_tokens[{}]"
    """Where the reply holds token ``i`` (``token_field.format(i)``), for error messages."""
    logprob_field: str = "output_logprobs[{}]"
    """Where the reply holds the logprob of token ``i``, for error messages."""


NO_PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""Sent with every generation request, in both families' sampling fields: vLLM and SGLang fill a field a
request leaves out from the model's ``generation_config.json`` (vLLM's ``--generation-config auto`` and
SGLang's ``--sampling-defaults model``, both their defaults), and Qwen2.5-Instruct's, for one, asks for
``repetition_penalty: 1.05``: the rollouts would be sampled from a distribution the trainer's logprobs
do not describe."""

LOGPROB_TOLERANCE = 1e-3
"""A sampled token's logprob above this (a probability over 1, beyond rounding) is a broken reply."""


def check_chunk(chunk: GenerationChunk, max_tokens: int, vocab_size: int | None = None) -> GenerationChunk:
    """``chunk`` with float logprobs, or :class:`MalformedResponseError` (retried like malformed JSON) naming
    the reply's field when it cannot be trained on: more tokens than asked for, a token id that is not an
    integer in ``[0, vocab_size)`` (the trainer's vocabulary; None: below ``TOKEN_ID_LIMIT``, which no
    vocabulary reaches and a trajectory's int32 ids cannot hold), a logprob
    that is null, not a number, NaN, infinite or positive.

    Every reply of every episode passes here on the pool's event loop, so a clean reply is checked in a
    few passes over its lists that run in C (``map`` of a builtin, where a generator expression steps a
    Python frame per token); the first bad entry is looked for, and named, only when there is one."""
    tokens, values = chunk.output_tokens, chunk.output_logprobs
    if len(tokens) > max_tokens:
        raise MalformedResponseError(f"{len(tokens)} tokens for a request of at most {max_tokens}")
    upper = TOKEN_ID_LIMIT if vocab_size is None else vocab_size
    if not set(map(type, tokens)) <= _INT or (tokens and not (min(tokens) >= 0 and max(tokens) < upper)):
        _raise_bad_token(chunk, vocab_size)
    logprobs = _floats(values)
    if logprobs is None or (logprobs and (not all(map(math.isfinite, logprobs)) or max(logprobs) > LOGPROB_TOLERANCE)):
        _raise_bad_logprob(chunk)
    return replace(chunk, output_logprobs=logprobs)


def _floats(values: list) -> list[float] | None:
    """``values`` as floats, or None when one is not a number (or an integer beyond a float's range)."""
    if not set(map(type, values)) <= _NUMBER:
        return None
    try:
        return list(map(float, values))
    except OverflowError:
        return None


_INT = frozenset({int})
_NUMBER = frozenset({int, float})
"""The types a reply's token ids and logprobs may have (``bool`` is neither: ``type(True) is bool``)."""


def _raise_bad_token(chunk: GenerationChunk, vocab_size: int | None) -> None:
    for i, token in enumerate(chunk.output_tokens):
        field_name = chunk.token_field.format(i)
        if isinstance(token, bool) or not isinstance(token, int):
            raise MalformedResponseError(f"{field_name} is {token!r:.40}, not a token id")
        if token < 0:
            raise MalformedResponseError(f"{field_name}: negative token id {token}")
        if vocab_size is not None and token >= vocab_size:
            raise MalformedResponseError(
                f"{field_name}: token id {token} is outside the trainer's vocabulary of {vocab_size} "
                "(does the server serve the trainer's model?)"
            )
        if token >= TOKEN_ID_LIMIT:
            raise MalformedResponseError(
                f"{field_name}: token id {token} is beyond any vocabulary (a trajectory's ids are int32, "
                f"below {TOKEN_ID_LIMIT})"
            )


def _raise_bad_logprob(chunk: GenerationChunk) -> None:
    for i, value in enumerate(chunk.output_logprobs):
        field_name = chunk.logprob_field.format(i)
        if value is None:
            raise MalformedResponseError(f"{field_name} is null: the reply has no logprob for token {i}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MalformedResponseError(f"{field_name} is {value!r:.40}, not a number")
        if not math.isfinite(_float_or_inf(value)) or value > LOGPROB_TOLERANCE:
            raise MalformedResponseError(f"{field_name}: logprob {value!r} is not a log-probability (finite, <= 0)")


def _float_or_inf(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond a float's range
        return math.inf


def split_routes(rows, n_input: int, n_tokens: int, where: str) -> tuple[list[list[int]], list[list[int]]]:
    """A reply's routed experts, one row per forwarded position from the first input token (the last
    generated token is not forwarded), as (input tokens after the first, generated tokens)."""
    expected = n_input - 1 + n_tokens
    if len(rows) != expected:
        raise MalformedResponseError(
            f"{where} has routes for {len(rows)} positions; expected {expected} ({n_input} input tokens and "
            f"{n_tokens} new tokens, less the last, which was not forwarded)"
        )
    if n_tokens == 0:
        return rows, []
    return rows[: n_input - 1], rows[n_input - 1 :]


@dataclass(frozen=True)
class HttpCall:
    """One control-plane call: ``method endpoint`` with an optional JSON body and query."""

    endpoint: str
    payload: Any = None
    method: str = "POST"
    params: dict[str, str] = field(default_factory=dict)


class InferenceBackend(abc.ABC):
    """Translates generation and pause/resume into one server family's HTTP API."""

    name: str
    generate_endpoint: str
    health_endpoint: str = "/health"
    return_routed_experts: bool = False
    """Ask for the experts each generated token was routed to (``rollout.return_routed_experts``)."""
    vocab_size: int | None = None
    """The trainer's vocabulary: a reply holding a token id at or beyond it is refused (None: not checked)."""

    @abc.abstractmethod
    def generate_payload(
        self,
        input_ids: list[int],
        gconfig: GenerationHyperparameters,
        max_new_tokens: int,
        min_new_tokens: int,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        """Body of a request generating at most ``max_new_tokens`` after ``input_ids``, under the loaded LoRA
        adapter ``adapter`` (None: the server's base model; :attr:`ServerSet.adapter
        <megarl.serving.servers.ServerSet.adapter>` says which one the run serves)."""

    @abc.abstractmethod
    def parse_generate(self, body: Any) -> GenerationChunk:
        """The chunk in a generate reply; ``MalformedResponseError`` if the body is not one."""

    @abc.abstractmethod
    def score_payload(self, prompt: list[int] | str, top_k: int = 0) -> dict[str, Any]:
        """Body of a request for the server's logprob of each token of ``prompt`` (token ids, or a text it
        tokenizes) given the tokens before it, at temperature 1: a teacher's logprobs (on-policy distillation);
        with ``top_k``, its ``top_k`` most likely tokens at each position too (:meth:`parse_top_k`)."""

    @abc.abstractmethod
    def parse_score(self, body: Any) -> list[tuple[int, float]]:
        """``(token id, logprob)`` of the prompt's tokens from the second on, in a reply to :meth:`score_payload`;
        ``MalformedResponseError`` if the body is not one."""

    @abc.abstractmethod
    def parse_top_k(self, body: Any, k: int) -> list[list[tuple[int, float]]]:
        """The ``k`` most likely ``(token id, logprob)`` at each of the prompt's positions from the second on,
        most likely first, in a reply to :meth:`score_payload` with ``top_k=k``; ``MalformedResponseError`` if
        the body is not one or a position holds fewer."""

    @abc.abstractmethod
    def pause_calls(self) -> list[HttpCall]:
        """Calls that stop generation on a server, aborting in-flight requests with their tokens so far."""

    @abc.abstractmethod
    def resume_calls(self) -> list[HttpCall]:
        """Calls that let a paused server generate again (and drop caches made stale by new weights)."""

    @abc.abstractmethod
    def sleep_calls(self) -> list[HttpCall]:
        """Calls that stop generation (aborting in-flight requests) and free the server's device memory
        for a colocated trainer: weights offloaded to host memory, KV cache dropped."""

    @abc.abstractmethod
    def wake_calls(self) -> list[HttpCall]:
        """Calls that bring a sleeping server's weights and KV cache back (new weights are pushed next)."""


def each_of_top_k(top: list[list[tuple[int, float]]], k: int, field: str) -> list[list[tuple[int, float]]]:
    """``top``, if every position holds ``k`` tokens; else ``MalformedResponseError`` naming the first that does not."""
    short = next((i for i, entry in enumerate(top) if len(entry) != k), None)
    if short is not None:
        raise MalformedResponseError(f"{field} holds {len(top[short])} of the top {k} tokens at position {short + 1}")
    return top
