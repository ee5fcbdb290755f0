"""The consistency metric: after an update, servers and trainer must score a probe alike.

A few trajectories are sampled from a server once (the probe). After every update the
trainer (collective forward) and every server (prompt logprobs) score each probe token
given its prefix; :func:`compare` reports max and mean ``|Δ logprob|`` per server and
overall. A server's mean above the threshold fails the update loudly (:class:`ConsistencyError`): a
server whose weights differ from the trainer's silently poisons every later sample.

The full-distribution probe (``weight_update.probe_topk``): every server also returns its top-k
logprobs at each probe position, the trainer scores the same tokens, and :func:`compare_topk`
reports the KL over them (plus a bucket for the rest of the vocabulary) and the max and mean
``|Δ logprob|``; a mean above the gap warning's threshold is a warning (:func:`topk_warning`).
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

    def as_dict(self, numbers: dict[str, int] | None = None) -> dict[str, float]:
        """The figures, per server as ``server{i}/...``: ``i`` from ``numbers`` (address -> its number in
        the run's server list), else the server's place in ``per_server``."""
        out = {"logprob_diff_max": self.max_abs, "logprob_diff_mean": self.mean_abs}
        for i, (max_abs, mean_abs) in _numbered(self.per_server, numbers):
            out[f"server{i}/logprob_diff_max"], out[f"server{i}/logprob_diff_mean"] = max_abs, mean_abs
        return out


def _numbered(per_server: dict[str, tuple], numbers: dict[str, int] | None) -> list[tuple[int, tuple]]:
    """(number, figures) of each server: its number in ``numbers``, else its place in ``per_server``."""
    return [((numbers or {}).get(address, i), figures) for i, (address, figures) in enumerate(per_server.items())]


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


def trainer_probe_scores(
    engine, sequences: list[list[int]], ids: torch.Tensor | None = None
) -> tuple[list[list[float]], torch.Tensor | None]:
    """One forward for the whole probe under the trainer's weights (collective): the logprob of every token
    but the first of each sequence and, given ``ids`` ``[B, S, K]`` (:func:`topk_ids`), those candidates'
    logprobs ``[B, S, K]`` at temperature 1, untruncated, as the servers' prompt logprobs are (None without
    ``ids``). The tokens' own logprobs come from the same head pass as the candidates' then."""
    batch = probe_batch(sequences)
    if ids is None:
        logp = engine.eval().forward(batch)  # [B, S]: position t scores token t + 1
        return _per_sequence(logp, sequences), None
    batch["probe_ids"] = ids

    def hook(head, mb: dict) -> torch.Tensor:
        candidates = torch.cat([mb["labels"][:, None], mb["probe_ids"]], dim=1)  # the token itself first
        return head.candidate_logprobs(candidates) * mb["label_mask"][:, None]  # [T, 1 + K]

    out = engine.eval().forward(batch, hook)
    return _per_sequence(out[..., 0], sequences), out[..., 1:]


def _per_sequence(logp: torch.Tensor, sequences: list[list[int]]) -> list[list[float]]:
    return [logp[i, : len(seq) - 1].double().tolist() for i, seq in enumerate(sequences)]


def sample_probe(control, count: int, tokens: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``count`` trajectories of ``tokens`` sampled by ``control``'s server after short random prompts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(0, vocab_size, (4,), generator=gen).tolist()
        out.append(control.generate(prompt, tokens, seed + i))
    return out


# ---------------------------------------------------------------------------- full-distribution probe
# Two engines can agree on the sampled token and differ elsewhere: each server's top-k logprobs at
# every probe position are compared with the trainer's logprobs of the same tokens.

TopK = list[list[dict[int, float]]]
"""Per probe sequence, per position t >= 1: a server's top-k ``{token id: logprob}`` of token t."""


@dataclass
class TopKReport:
    """Per server (mean KL, max |Δ logprob|, mean |Δ logprob|) over the probe positions' top-k tokens.

    The KL is KL(server || trainer) over the server's top-k tokens plus one bucket holding the rest
    of the vocabulary (a lower bound of the full KL that needs only the k logprobs per side).
    """

    k: int
    per_server: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def worst_mean(self) -> float:
        """The largest per-server mean |Δ logprob| over the top-k tokens (what a warning threshold applies to)."""
        return max((m for _, _, m in self.per_server.values()), default=0.0)

    def as_dict(self, numbers: dict[str, int] | None = None) -> dict[str, float]:
        """The figures, per server as ``server{i}/...`` (``numbers``: as :meth:`ConsistencyReport.as_dict`)."""
        values = list(self.per_server.values())
        if not values:
            return {}
        out = {
            "topk_kl": max(kl for kl, _, _ in values),
            "topk_logprob_diff_max": max(mx for _, mx, _ in values),
            "topk_logprob_diff_mean": self.worst_mean,
        }
        for i, (kl, max_abs, mean_abs) in _numbered(self.per_server, numbers):
            out[f"server{i}/topk_kl"] = kl
            out[f"server{i}/topk_logprob_diff_max"] = max_abs
            out[f"server{i}/topk_logprob_diff_mean"] = mean_abs
        return out


def topk_ids(servers: dict[str, TopK], sequences: list[list[int]], k: int) -> torch.Tensor:
    """``[B, S, k * n_servers]`` token ids to score, in next-token alignment (position t: candidates
    for token t + 1): server i's top-k in slots ``[i k, (i + 1) k)`` (its first id repeated if it sent fewer)."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, k * len(servers), dtype=torch.int64)
    for i, topk in enumerate(servers.values()):
        for b, positions in enumerate(topk):
            for t, entries in enumerate(positions):
                tokens = list(entries)[:k] or [0]
                ids[b, t, i * k : (i + 1) * k] = torch.tensor(tokens + tokens[:1] * (k - len(tokens)))
    return ids


def compare_topk(trainer: torch.Tensor, servers: dict[str, TopK], k: int) -> TopKReport:
    """The :class:`TopKReport` of each server's top-k against the trainer's logprobs ``trainer`` [B, S, K]
    of the same tokens (:func:`trainer_probe_scores` of :func:`topk_ids`)."""
    report = TopKReport(k=k)
    for i, (address, topk) in enumerate(servers.items()):
        ours, theirs = [], []
        for b, positions in enumerate(topk):
            for t, entries in enumerate(positions):
                values = list(entries.values())[:k]
                theirs.append(torch.tensor(values, dtype=torch.float64))
                ours.append(trainer[b, t, i * k : i * k + len(values)].double())
        if not theirs:
            continue
        diffs = torch.cat([(a - b).abs() for a, b in zip(ours, theirs)])
        kl = torch.stack([bucketed_kl(s, t) for s, t in zip(theirs, ours)])
        report.per_server[address] = (float(kl.mean()), float(diffs.max()), float(diffs.mean()))
    return report


def bucketed_kl(server: torch.Tensor, trainer: torch.Tensor) -> torch.Tensor:
    """KL(server || trainer) over k tokens' logprobs ``[k]`` plus one bucket for the rest of the vocabulary."""
    p, q = server.exp(), trainer.exp()
    rest_p = (1 - p.sum()).clamp(min=0.0)
    rest_q = (1 - q.sum()).clamp(min=1e-12)
    rest = torch.where(rest_p > 0, rest_p * (rest_p.clamp(min=1e-12).log() - rest_q.log()), 0.0)
    return (p * (server - trainer)).sum() + rest


def topk_warning(report: TopKReport, threshold: float) -> str | None:
    """A console line when a server's mean |Δ logprob| over its top-k tokens passes ``threshold``."""
    mean = report.worst_mean
    if threshold <= 0 or mean <= threshold:
        return None
    return (
        f"full-distribution probe: the servers' top-{report.k} logprobs differ from the trainer's by {mean:.4g} "
        f"on average (> {threshold:g}; KL over them {report.as_dict()['topk_kl']:.4g}): the servers' "
        "distributions differ from the trainer's beyond the sampled tokens"
    )
