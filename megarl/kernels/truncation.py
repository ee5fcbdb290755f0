"""Truncation replay: token logprobs under the truncated, renormalised distribution a server sampled from.

vLLM 0.32 samples from z = logits / T (fp32) after three filters, in this order
(``vllm/v1/sample/sampler.py``, ``logits_processor/builtin.py``, ``ops/topk_topp_sampler.py``):

1. **min-p** (a logits processor, before top-k and top-p): v is dropped where
   softmax(z)_v < min_p · max softmax(z), i.e. where z_v < max z + log(min_p);
2. **top-k**: v is dropped where z_v is below the k-th largest z (ties with it are kept);
3. **top-p**, over what is left, renormalised: sorted ascending, v is dropped while the cumulative
   mass up to and including v is <= 1 - p (the largest always stays). Equivalently, v stays iff
   the mass strictly above z_v is < p.

Each filter keeps the tokens at or above a value, so the kept set of a token position is
``{v : z_v >= theta}`` for one per-token threshold theta, and the logprob of the sampled token y is
``z_y - logsumexp_{z_v >= theta} z_v``; its gradient is the softmax over the kept set (the threshold
is piecewise constant in the weights). Ties at the top-p boundary: vLLM's unstable sort may keep a
part of a group of equal logits; here the whole group is kept (equal fp32 logits of distinct
tokens are rare outside duplicated weight rows).

**How the threshold is found without the [T, V] logits** (:func:`truncated_stats`): one pass over
the vocabulary in chunks keeps, per token, the C + 1 largest z (a running ``topk`` merged with
each chunk's), the max and the sum of exp (the full softmax's normaliser, which top-p without
top-k or min-p needs) and the label's logit. Under tensor parallelism each rank does this over
its shard, then one ``all_gather`` of the ``[T, C + 1]`` candidates (tp · T · (C + 1) floats, a
``topk`` of the gathered ones gives the global C + 1 largest) and the MAX / SUM all-reduces of
the statistics the untruncated path already does. From the candidates every threshold follows:
min-p's from the max, top-k's is the k-th candidate, top-p's from the descending cumulative
mass. A sampled token below its threshold (a numerical edge: vLLM's fp32 cumulative sum put it
on the other side of the boundary) would have logprob -inf; its threshold is lowered to its own
logit and it is counted (``outside``). The threshold kept is halfway between the smallest kept and
the largest dropped logit, so that the backward's recomputed logits pick the same set. The kept set must lie within the first C candidates (the
(C + 1)-th below theta, which also makes ties at the boundary visible); positions where it does
not (a flat distribution whose nucleus holds more than C tokens) are scanned again with 4 x C
candidates, only those rows, in blocks of rows whose candidates fit one chunk's
``chunk_tokens x chunk_vocab`` budget, until it does (at worst C reaches the vocabulary). The
truncated statistics (max, sum exp, sum exp · z) then come from the candidates: the forward
costs one pass over the logits, like the untruncated one, plus the top-k merges (and one more
pass per growth for the rows that need it); the backward recomputes the logits as before and
masks those below theta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.kernels.reference import VocabShard, _chunks, _label_in_chunk, _scaled_logits, rescale_stats

__all__ = ["Truncation", "truncated_stats", "truncated_stats_of_logits", "truncation_thresholds"]


@dataclass(frozen=True)
class Truncation:
    """The sampling filters to replay (vLLM's ``top_k``, ``top_p``, ``min_p``)."""

    top_k: int = -1
    """Keep the k largest logits (and ties with the k-th); <= 0: off."""
    top_p: float = 1.0
    """Keep the smallest set of largest logits whose mass reaches top_p; 1: off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the largest; 0: off."""
    candidates: int = 256
    """Candidates kept per token by the first scan (grown 4x for the positions they do not cover)."""

    @property
    def active(self) -> bool:
        """Whether any filter is on."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def check(self) -> None:
        """ValueError on a value vLLM would refuse."""
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {self.candidates}")


def _local_candidates(hidden, weight, label_local, shard: VocabShard, inv_tau, n, chunk_tokens, chunk_vocab):
    """This shard's n largest z ``[T, n]`` (-inf padded), max, sum exp relative to it, label logit ``[T]``."""
    num_tokens = hidden.shape[0]
    opts = {"dtype": torch.float32, "device": hidden.device}
    top = torch.full((num_tokens, n), -math.inf, **opts)
    m = torch.full((num_tokens,), -math.inf, **opts)
    s = torch.zeros(num_tokens, **opts)
    label_logit = torch.zeros(num_tokens, **opts)
    for v0, v1 in _chunks(shard.valid, chunk_vocab):
        w_c = weight[v0:v1].float()  # [vc,H]
        for t0, t1 in _chunks(num_tokens, chunk_tokens):
            z = _scaled_logits(hidden[t0:t1].float(), w_c, inv_tau)  # [tc,vc]
            idx, inside = _label_in_chunk(label_local[t0:t1], v0, v1)
            label_logit[t0:t1] += torch.where(inside, z.gather(1, idx[:, None]).squeeze(1), 0.0)
            both = torch.cat([top[t0:t1], z], dim=1)  # [tc, n + vc]
            top[t0:t1] = both.topk(min(n, both.shape[1]), dim=1).values
            cm = z.amax(dim=1)  # [tc]
            m_new = torch.maximum(m[t0:t1], cm)
            s_old, _ = rescale_stats(m[t0:t1], s[t0:t1], torch.zeros_like(cm), m_new)
            s[t0:t1] = s_old + (z - m_new[:, None]).exp().sum(dim=1)
            m[t0:t1] = m_new
    return top, m, s, label_logit


def _global_candidates(top, m, s, label_logit, tp_group, tp_size):
    """Over the TP group: the n largest of all ranks' candidates, the global max, sum exp and label logit."""
    if tp_size == 1:
        return top, m, s, label_logit
    top = _gather_candidates(top, tp_group, tp_size)
    m_all = m.clone()
    dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=tp_group)
    s_to, _ = rescale_stats(m, s, torch.zeros_like(s), m_all)
    packed = torch.stack([s_to, label_logit])  # [2,T]
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
    return top, m_all, packed[0], packed[1]


def _gather_candidates(top, tp_group, tp_size):
    """The n largest ``[T, n]`` of all ranks' candidates ``[T, n]`` (one all_gather)."""
    if tp_size == 1:
        return top
    parts = [torch.empty_like(top) for _ in range(tp_size)]
    dist.all_gather(parts, top.contiguous(), group=tp_group)
    return torch.cat(parts, dim=1).topk(top.shape[1], dim=1).values


def truncation_thresholds(
    top: torch.Tensor, m: torch.Tensor, s: torch.Tensor, trunc: Truncation, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(theta ``[T]``, covered ``[T]`` bool) from the C + 1 largest z per token (descending, ``[T, C + 1]``),
    the max m and sum exp(z - m) s over the whole vocabulary.

    ``covered``: the kept set ``{z >= theta}`` lies within the first C candidates, so theta and
    the truncated statistics are exact.
    """
    n = top.shape[1] - 1  # C: the (C + 1)-th candidate only tells whether the kept set ends within the first C
    everything = n >= vocab_size  # every token is a candidate
    theta = torch.full_like(m, -math.inf)
    if trunc.min_p > 0:
        theta = m + math.log(trunc.min_p)
    if 0 < trunc.top_k < vocab_size:
        theta = torch.maximum(theta, top[:, min(trunc.top_k, n) - 1])
    if trunc.top_p < 1:
        theta = _top_p_threshold(top[:, :n], m, s, theta, trunc.top_p, everything)
    covered = torch.full_like(m, True, dtype=torch.bool) if everything else top[:, n] < theta
    if 0 < trunc.top_k < vocab_size and trunc.top_k > n:
        covered = torch.zeros_like(covered)
    return theta, covered


def _top_p_threshold(top, m, s, theta_before, p: float, everything: bool) -> torch.Tensor:
    """The top-p threshold over the tokens at or above ``theta_before`` (renormalised); -inf where unknown."""
    kept_before = top >= theta_before[:, None]  # [T,C]
    mass = torch.where(kept_before, (top.double() - m.double()[:, None]).exp(), 0.0)  # [T,C]
    # the normaliser over the kept set: from the candidates where they hold all of it, else the
    # full softmax's (right when nothing was dropped before: theta_before = -inf)
    from_candidates = ~kept_before[:, -1] | everything
    total = torch.where(from_candidates, mass.sum(dim=1), s.double())
    above = mass.cumsum(dim=1) - mass  # [T,C] mass strictly above each candidate (exclusive)
    keep = (above < p * total[:, None]) & kept_before
    last = keep.sum(dim=1).clamp(min=1) - 1  # kept candidates are a prefix
    theta = top.gather(1, last[:, None]).squeeze(1)
    # all C kept but mass still short of p: the nucleus goes on past the candidates (not covered)
    short = keep[:, -1] & (not everything)
    return torch.where(short, torch.full_like(theta, -math.inf), torch.maximum(theta, theta_before))


def _scan(hidden, labels, hit, rows, weight, shard, inv_tau, trunc: Truncation, n: int, stats, outside, comm):
    """One candidate scan of ``rows`` with n candidates: fills ``stats`` (m, s, u, label_logit, theta)
    and ``outside`` of the rows it covers; returns the others."""
    tp_group, tp_size, chunk_tokens, chunk_vocab = comm
    label_local = labels[rows] - shard.start
    top, m, s, lab = _local_candidates(
        hidden[rows], weight, label_local, shard, inv_tau, n + 1, chunk_tokens, chunk_vocab
    )
    top, m, s, lab = _global_candidates(top, m, s, lab, tp_group, tp_size)
    theta, covered, out = _threshold_from_candidates(top, m, s, lab, hit[rows], trunc, n, shard.vocab_size)
    kept_s, kept_u = _kept_sums(top[covered, :n], m[covered], theta[covered])
    done = rows[covered]
    for i, value in enumerate((m[covered], kept_s, kept_u, lab[covered])):
        stats[i][done] = value
    stats[4][done] = theta[covered]
    outside[done] = out[covered]
    return rows[~covered]


def _kept_sums(top, m, theta):
    """(sum exp(z - m), sum exp(z - m) (z - m)) ``[r]`` over the candidates ``top`` ``[r, n]`` at or
    above theta (the kept set, which they hold whole)."""
    d = top - m[:, None]  # [r,n] <= 0
    e = torch.where(top >= theta[:, None], d.exp(), 0.0)
    return e.sum(dim=1), torch.where(e > 0, e * d, 0.0).sum(dim=1)


def _threshold_from_candidates(top, m, s, lab, hit, trunc: Truncation, n: int, vocab_size: int):
    """(theta, covered, outside) ``[r]`` from the global n + 1 largest z ``top`` ``[r, n + 1]``, max m,
    sum exp s, label logit lab and whether the label is real (hit)."""
    theta, covered = truncation_thresholds(top, m, s, trunc, vocab_size)
    out = hit & (lab < theta)  # the sampled token below its threshold: lowered to it
    theta = torch.where(out, lab, theta)
    if n < vocab_size:  # the kept set must still end within the first n candidates
        covered &= top[:, n] < theta
    # the same kept set for any threshold in (largest dropped logit, theta]: halfway between, so that
    # the backward's recomputed logits (other GEMM shapes, other roundings) select it too
    dropped = torch.where(top < theta[:, None], top, -math.inf).amax(dim=1)
    theta = torch.where(torch.isfinite(dropped), (theta + dropped) / 2, -math.inf)
    return theta, covered, out


def truncated_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    inv_tau: float,
    trunc: Truncation,
    tp_group: dist.ProcessGroup | None,
    tp_size: int,
    chunk_tokens: int,
    chunk_vocab: int,
) -> tuple[torch.Tensor, ...]:
    """Global statistics of the truncated distribution per token: (m, s, u, label_logit, theta, outside).

    (m, s, u, label_logit) as :func:`megarl.kernels.reference.local_stats_chunked`'s, reduced over
    the TP group, but over the kept tokens ``z >= theta`` only; ``outside`` marks labels that fell
    below their threshold (theta lowered to them). Collective over ``tp_group``; every rank gets
    the same values.
    """
    num_tokens = hidden.shape[0]
    opts = {"dtype": torch.float32, "device": hidden.device}
    stats = [torch.zeros(num_tokens, **opts) for _ in range(5)]  # m, s, u, label_logit, theta
    hit = (labels >= 0) & (labels < shard.vocab_size)
    outside = torch.zeros_like(hit)
    comm = (tp_group, tp_size, chunk_tokens, chunk_vocab)
    n = max(trunc.candidates, trunc.top_k)
    rows = torch.arange(num_tokens, device=hidden.device)
    while rows.numel():  # the same rows on every TP rank: the candidates are global
        # a scan's candidates [rows, n + 1] stay within one chunk's budget: blocks of rows
        block = max(1, chunk_tokens * chunk_vocab // (n + 1))
        args = (weight, shard, inv_tau, trunc, n, stats, outside, comm)
        left = [_scan(hidden, labels, hit, rows[b0 : b0 + block], *args) for b0 in range(0, rows.numel(), block)]
        rows, n = torch.cat(left), n * 4
    m, s, u, label_logit, theta = stats
    return m, s, u, label_logit, theta, outside


def truncated_stats_of_logits(
    logits: torch.Tensor,
    scale: float,
    m: torch.Tensor,
    s: torch.Tensor,
    label_logit: torch.Tensor,
    hit: torch.Tensor,
    shard: VocabShard,
    trunc: Truncation,
    tp_group: dist.ProcessGroup | None,
    tp_size: int,
) -> tuple[torch.Tensor, ...]:
    """:func:`truncated_stats` of a token chunk whose logits this rank holds (the training path,
    ``megarl.kernels.linear_loss``): (m, s, u, label_logit, theta, outside) ``[tc]`` of the truncated
    distribution.

    ``logits`` ``[tc, >= shard.valid]``: the chunk's logits of this shard, z / ``scale`` in its first
    ``shard.valid`` columns (``scale`` = 1 / temperature where they are the raw logits, 1 where
    they are z); (m, s, label_logit) ``[tc]``: the chunk's global max, sum exp(z - m) and label
    logit over the whole vocabulary (already reduced over TP); ``hit``: the label is a real token.
    The candidates are a ``topk`` of the stored logits (no GEMM), gathered over the TP group as
    :func:`truncated_stats` does; positions the first C do not cover take 4 x C, from the same
    logits (a copy of those rows). Collective over ``tp_group``.
    """
    num_tokens, opts = logits.shape[0], {"dtype": torch.float32, "device": logits.device}
    kept_s, kept_u = torch.zeros(num_tokens, **opts), torch.zeros(num_tokens, **opts)
    theta = torch.full((num_tokens,), -math.inf, **opts)
    outside = torch.zeros(num_tokens, dtype=torch.bool, device=logits.device)
    n = max(trunc.candidates, trunc.top_k)
    rows, first = torch.arange(num_tokens, device=logits.device), True
    while rows.numel():  # the same rows on every TP rank: the candidates are global
        part = logits[:, : shard.valid] if first else logits.index_select(0, rows)[:, : shard.valid]
        top = _gather_candidates(_top_of(part, n + 1, scale), tp_group, tp_size)  # [r, n + 1]
        args = (m[rows], s[rows], label_logit[rows], hit[rows], trunc, n, shard.vocab_size)
        row_theta, covered, out = _threshold_from_candidates(top, *args)
        done = rows[covered]
        kept_s[done], kept_u[done] = _kept_sums(top[covered, :n], m[done], row_theta[covered])
        theta[done], outside[done] = row_theta[covered], out[covered]
        rows, n, first = rows[~covered], n * 4, False
    return m, kept_s, kept_u, label_logit, theta, outside


def _top_of(logits: torch.Tensor, k: int, scale: float) -> torch.Tensor:
    """The k largest of each row of ``logits`` ``[r, v]`` times ``scale`` ``[r, k]``, -inf padded past v."""
    found = min(k, logits.shape[1])
    top = logits.topk(found, dim=1).values if found else logits.new_empty(logits.shape[0], 0)
    top = top * scale if scale != 1 else top
    pad = top.new_full((top.shape[0], k - found), -math.inf)
    return torch.cat([top, pad], dim=1) if k > found else top
