"""Requests and responses between workflows and inference engines (AReaL's ``io_struct``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.rollout import GenerationHyperparameters

StopReason = Literal["stop", "length", "abort"]
"""Why generation ended: an end-of-sequence token or stop string ("stop"), the token
budget or context length ("length"), or a server-side abort that was not continued
("abort"; only seen when the engine is destroyed mid-request)."""


@dataclass
class ModelRequest:
    """One generation request: a token-id prompt and how to sample its continuation.

    Requests sharing ``rid`` (the samples of one prompt, the turns of one episode) are
    routed to the same server so its prefix cache holds their common prefix.
    """

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Request id; the sticky-routing key."""
    input_ids: list[int] = field(default_factory=list)
    """Prompt token ids (for a continued episode: everything so far)."""
    gconfig: GenerationHyperparameters = field(default_factory=lambda: GenerationHyperparameters(n_samples=1))
    """Sampling settings; ``agenerate`` produces one sample whatever ``n_samples`` says."""
    tokenizer: Any = None
    """Optional tokenizer, for workflows that want the engine to decode (unused by the HTTP client)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form data a workflow wants carried along (not sent to the server)."""

    def copy(self) -> ModelRequest:
        """A shallow copy whose ``input_ids`` list can be extended independently."""
        return ModelRequest(
            rid=self.rid,
            input_ids=list(self.input_ids),
            gconfig=self.gconfig,
            tokenizer=self.tokenizer,
            metadata=dict(self.metadata),
        )


@dataclass
class ModelResponse:
    """A finished generation, token-aligned: ``output_logprobs[i]`` and
    ``output_versions[i]`` belong to ``output_tokens[i]``.

    A generation interrupted by a weight update and continued on new weights has
    tokens of several versions; ``output_versions`` records each token's.
    """

    input_tokens: list[int] = field(default_factory=list)
    """The prompt as sent."""
    output_tokens: list[int] = field(default_factory=list)
    """Generated token ids."""
    output_logprobs: list[float] = field(default_factory=list)
    """Log-probability of each generated token under the weights that produced it."""
    output_versions: list[int] = field(default_factory=list)
    """Weight version that produced each generated token."""
    stop_reason: StopReason = "stop"
    """Why generation ended."""
    latency: float = 0.0
    """Seconds from the call to the last token (pauses included)."""
    ttft: float = 0.0
    """Seconds to the first response from a server (time to first chunk)."""
    n_interruptions: int = 0
    """How many times the generation was aborted by a pause and continued."""
    server: str = ""
    """Address of the server that produced the last chunk."""
    output_routed_experts: list[list[int]] | None = None
    """MoE, with ``rollout.return_routed_experts``: per generated token, every layer's top-k experts (layer-major)."""
    tokenizer: Any = None
    """The request's tokenizer, passed through."""

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)

    def check_aligned(self) -> None:
        """Raise ``ValueError`` unless tokens, logprobs and versions have one entry each."""
        n = len(self.output_tokens)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ValueError(
                f"ModelResponse misaligned: {n} output tokens, {len(self.output_logprobs)} logprobs, "
                f"{len(self.output_versions)} versions"
            )
