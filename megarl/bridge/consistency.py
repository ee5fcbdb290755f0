"""The consistency metric: after an update, servers and trainer must score a probe alike.

A few trajectories are sampled from a server once (the probe). After every update the
trainer (collective forward) and every server (prompt logprobs) score each probe token
given its prefix; :func:`compare` reports max and mean ``|Δ logprob|`` per server and
overall. A server's mean above the threshold fails the update loudly (:class:`ConsistencyError`): a
server whose weights differ from the trainer's silently poisons every later sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


class ConsistencyError(RuntimeError):
    """A server's logprobs of the probe differ from the trainer's by more than the threshold."""


@dataclass
class ConsistencyReport:
    """max / mean |Δ logprob| between trainer and each server on the probe tokens."""

    per_server: dict[str, tuple[float, float]] = field(default_factory=dict)
    threshold: float = 0.0

    @property
    def max_abs(self) -> float:
        return max((m for m, _ in self.per_server.values()), default=0.0)

    @property
    def mean_abs(self) -> float:
        values = [m for _, m in self.per_server.values()]
        return sum(values) / len(values) if values else 0.0

    @property
    def worst_mean(self) -> float:
        """The largest per-server mean |Δ logprob| (what the threshold applies to)."""
        return max((m for _, m in self.per_server.values()), default=0.0)

    @property
    def ok(self) -> bool:
        # The mean, not the max: bf16 trainer and server kernels differ by up to ~0.3 nats on
        # single tokens of a real model (SmolLM2-135M: max 0.28, mean 0.056), while wrong or
        # half-updated weights move the mean by whole nats.
        return self.threshold <= 0 or self.worst_mean <= self.threshold

    def as_dict(self) -> dict[str, float]:
        out = {"logprob_diff_max": self.max_abs, "logprob_diff_mean": self.mean_abs}
        for i, (max_abs, mean_abs) in enumerate(self.per_server.values()):
            out[f"server{i}/logprob_diff_max"], out[f"server{i}/logprob_diff_mean"] = max_abs, mean_abs
        return out


def compare(trainer: list[list[float]], servers: dict[str, list[list[float]]], threshold: float) -> ConsistencyReport:
    """Per server, max and mean |trainer - server| over all probe tokens."""
    report = ConsistencyReport(threshold=threshold)
    ref = torch.tensor([x for seq in trainer for x in seq], dtype=torch.float64)
    for address, scores in servers.items():
        got = torch.tensor([x for seq in scores for x in seq], dtype=torch.float64)
        if got.shape != ref.shape:
            raise ValueError(f"server {address} scored {got.numel()} probe tokens, the trainer {ref.numel()}")
        diff = (got - ref).abs()
        report.per_server[address] = (float(diff.max()), float(diff.mean()))
    return report


def probe_batch(sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """The trajectory batch (right-padded ``[B, S]``) the actor's forward takes."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = True
    return {"input_ids": ids, "attention_mask": mask}


def trainer_scores(engine, sequences: list[list[int]]) -> list[list[float]]:
    """Logprob of every token but the first of each sequence under the trainer's weights (collective)."""
    logp = engine.eval().forward(probe_batch(sequences))  # [B, S]: position t scores token t + 1
    return [logp[i, : len(seq) - 1].double().tolist() for i, seq in enumerate(sequences)]


def sample_probe(control, count: int, tokens: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``count`` trajectories of ``tokens`` sampled by ``control``'s server after short random prompts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(0, vocab_size, (4,), generator=gen).tolist()
        out.append(control.generate(prompt, tokens, seed + i))
    return out
