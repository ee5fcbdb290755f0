"""The small interface behind which each inference server's HTTP dialect lives.

One implementation per file: :mod:`megarl.rollout.vllm` and :mod:`megarl.rollout.sglang`.
A backend only translates: a generation step into a request body and the reply into a
:class:`GenerationChunk`, and pause / resume into endpoint calls. Retries, routing and
continuation are the engine's.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.api.io_struct import GenerationHyperparameters
from megarl.rollout.http import MalformedResponseError

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class GenerationChunk:
    """What one ``/generate``-style call produced (possibly cut short by a pause)."""

    output_tokens: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    routed_experts: list[list[int]] | None = None
    """MoE, when asked for: per output token, every layer's top-k experts (layer-major)."""


LOGPROB_TOLERANCE = 1e-3
"""A sampled token's logprob above this (a probability over 1, beyond rounding) is a broken reply."""


def check_chunk(chunk: GenerationChunk, max_tokens: int) -> GenerationChunk:
    """``chunk``, or :class:`MalformedResponseError` (retried like malformed JSON) when it cannot be
    trained on: more tokens than asked for, a negative token id, a NaN, infinite or positive logprob."""
    if len(chunk.output_tokens) > max_tokens:
        raise MalformedResponseError(f"{len(chunk.output_tokens)} tokens for a request of at most {max_tokens}")
    bad_id = next((t for t in chunk.output_tokens if t < 0), None)
    if bad_id is not None:
        raise MalformedResponseError(f"negative token id {bad_id}")
    bad = next((lp for lp in chunk.output_logprobs if not math.isfinite(lp) or lp > LOGPROB_TOLERANCE), None)
    if bad is not None:
        raise MalformedResponseError(f"logprob {bad!r} is not a log-probability (finite, <= 0)")
    return chunk


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

    @abc.abstractmethod
    def generate_payload(
        self, input_ids: list[int], gconfig: GenerationHyperparameters, max_new_tokens: int, min_new_tokens: int
    ) -> dict[str, Any]:
        """Body of a request generating at most ``max_new_tokens`` after ``input_ids``."""

    @abc.abstractmethod
    def parse_generate(self, body: Any) -> GenerationChunk:
        """The chunk in a generate reply; ``MalformedResponseError`` if the body is not one."""

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
