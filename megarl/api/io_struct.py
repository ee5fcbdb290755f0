"""Requests and responses between workflows and inference engines (AReaL's ``io_struct``)."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from megarl.utils.errors import require

StopReason = Literal["stop", "length", "abort"]
"""Why generation ended: an end-of-sequence token or stop string ("stop"), the token
budget or context length ("length"), or a server-side abort that was not continued
("abort"; only seen when the engine is destroyed mid-request)."""


@dataclass
class GenerationHyperparameters:
    """How each trajectory is sampled (AReaL's ``gconfig``)."""

    n_samples: int = 1
    """Samples per prompt: the GRPO group size."""
    max_new_tokens: int = 256
    """Upper bound on generated tokens per sample (an interrupted sample keeps its budget)."""
    min_new_tokens: int = 0
    """Lower bound on generated tokens before a stop is allowed; 0: none."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores logprobs at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    min_p: float = 0.0
    """Min-p sampling: tokens below ``min_p`` x the most likely token's probability are dropped; 0 disables it."""
    greedy: bool = False
    """Greedy decoding (evaluation); ignores temperature, top_p and top_k."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, in addition to the tokenizer's end-of-sequence token."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop token ids."""
    seed: int | None = None
    """Reproducible sampling. None: the servers' own RNG. Set: each sample draws from a
    generator seeded by (seed, prompt tokens, sample index) (:meth:`for_sample`), so the same
    weights give the same rollouts in every run: recover and debugging runs repeat exactly.
    A continuation after a pause reseeds with the tokens generated so far."""

    def new(self, **changes) -> GenerationHyperparameters:
        """A copy with ``changes`` applied (e.g. ``gconfig.new(n_samples=1)``)."""
        return replace(self, **changes)

    def for_sample(self, input_ids: list[int], index: int) -> GenerationHyperparameters:
        """The settings of sample ``index`` of the prompt ``input_ids``: one sample, its own seed."""
        if self.seed is None:
            return self.new(n_samples=1)
        return self.new(n_samples=1, seed=derive_seed(self.seed, input_ids, index))

    def check(self) -> None:
        require(self.n_samples >= 1, "n_samples", self.n_samples, "must be >= 1")
        require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        require(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            self.min_new_tokens,
            f"must be in [0, max_new_tokens={self.max_new_tokens}]",
        )
        require(self.greedy or self.temperature > 0, "temperature", self.temperature, "must be > 0 (or set greedy)")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        require(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "must be -1 (off) or >= 1")
        require(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        require(self.seed is None or 0 <= self.seed < 2**63, "seed", self.seed, "must be null or in [0, 2**63)")
        bad_ids = [i for i in self.stop_token_ids if i < 0]
        require(not bad_ids, "stop_token_ids", self.stop_token_ids, f"token ids are >= 0, got {bad_ids}")
        require(all(self.stop), "stop", self.stop, "an empty stop string would end every sample at once")


def derive_seed(seed: int, tokens: list[int], index: int) -> int:
    """A 63-bit seed from ``seed``, a token sequence and an index (stable across processes and runs)."""
    digest = hashlib.blake2b(repr((seed, index, list(tokens))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


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
    """MoE, with ``rollout.return_routed_experts``: per generated token, every layer's top-k experts (layer-major)
    of the forward that produced it."""
    input_routed_experts: list[list[int]] | None = None
    """MoE, with ``rollout.return_routed_experts``: the same for each input token after the first."""
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


@dataclass
class FinetuneSpec:
    """The length of a training run (AReaL's ``FinetuneSpec``): what an engine's ``initialize(addr, ft_spec)``
    sizes its learning-rate schedule by."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    def __post_init__(self):
        for name in ("total_train_epochs", "dataset_size", "train_batch_size"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")

    @property
    def steps_per_epoch(self) -> int:
        """Whole batches per epoch (a last partial batch is dropped, as the trainer's dataloader does)."""
        return self.dataset_size // self.train_batch_size

    @property
    def total_train_steps(self) -> int:
        return self.total_train_epochs * self.steps_per_epoch
