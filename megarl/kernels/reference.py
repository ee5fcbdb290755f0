"""Exact torch implementations of the fused logprob + entropy kernel.

Two implementations live here:

* the **chunked** one, which the package runs on CPU (and on GPU when the CUDA kernel does
  not apply): it loops over vocab chunks x token chunks with an online logsumexp in fp32, so
  its peak memory is O(chunk_tokens x chunk_vocab), never [T, V]; its backward recomputes
  the logits chunk by chunk;
* the **naive** one (matmul -> log_softmax -> gather), materialising [T, V] fp32 logits; the
  benchmark's baseline.

Notation, per token t over the rows v of one vocab shard: z = hidden . weight^T / tau, and
three running statistics m = max z, s = sum exp(z - m), u = sum exp(z - m) (z - m). Then
lse = m + log s, the softmax mean of z is mean_z = m + u / s, the entropy is
log s - u / s, and the logprob of the label y is z_y - lse. Triples from disjoint parts of
the vocabulary merge exactly (``merge_stats``), across chunks, CUDA splits or TP ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "VocabShard",
    "bf16_products",
    "chunk_triple",
    "finalize_stats",
    "grads_chunked",
    "local_stats_chunked",
    "logprobs_entropy_naive",
    "merge_stats",
    "rescale_stats",
    "softmax_grad_",
]


@dataclass(frozen=True)
class VocabShard:
    """Which part of the global vocabulary one LM-head weight shard holds."""

    start: int
    """Global token id of the shard's first row (``rank * rows_per_rank`` under Megatron)."""
    valid: int
    """Rows of the shard that are real vocabulary; the rows after them are padding."""
    vocab_size: int
    """Real size of the global vocabulary; labels outside ``[0, vocab_size)`` are ignored."""


def rescale_stats(
    m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, m_to: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, u) re-expressed relative to a max ``m_to >= m``.

    An empty part (``m = -inf``, ``s = u = 0``) gives zeros; the ``(-inf) * 0`` products of
    a naive rescale are masked out.
    """
    present = torch.isfinite(m)
    shift = torch.where(present, m - m_to, torch.zeros_like(m))  # <= 0
    scale = torch.where(present, shift.exp(), torch.zeros_like(m))
    return scale * s, scale * (u + shift * s)


def merge_stats(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Merge per-part statistics ``[P, T]`` (over disjoint vocab parts) into ``[T]``."""
    m_all = m.amax(dim=0)  # [T]
    s_to, u_to = rescale_stats(m, s, u, m_all)  # [P,T]
    return m_all, s_to.sum(dim=0), u_to.sum(dim=0)


def finalize_stats(
    m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, label_logit: torch.Tensor, hit: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Global statistics ``[T]`` -> (logprob, entropy, lse, mean_z); logprob is 0 where not ``hit``."""
    log_s = s.log()
    lse = m + log_s
    mean_s = u / s  # softmax mean of (z - m)
    logprob = torch.where(hit, label_logit - lse, torch.zeros_like(lse))
    return logprob, log_s - mean_s, lse, m + mean_s


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


@contextlib.contextmanager
def bf16_products(enabled: bool = True) -> Iterator[None]:
    """fp32 CPU matmuls inside multiply in bf16 and sum in fp32 (oneDNN's bf16 math mode,
    ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``); a CPU without native bf16 keeps fp32.

    Only for fp32 copies of bf16 tensors (the chunks' logits GEMMs of a bf16 model): their values are
    bf16 already, so every product is exact and only the order of the fp32 sums differs, while the GEMM
    runs at bf16's rate. The mode is process-wide while it lasts; the previous one is put back.
    """
    if not enabled:
        yield
        return
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def _scaled_logits(h_c: torch.Tensor, w_c: torch.Tensor, inv_tau: float) -> torch.Tensor:
    """z = h_c . w_c^T * inv_tau [tc,vc]; the scale rides on the GEMM (alpha) instead of a pass."""
    return torch.addmm(h_c.new_zeros(()), h_c, w_c.T, beta=0.0, alpha=inv_tau)


def _label_in_chunk(label_local: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the label inside vocab chunk [v0, v1) clamped to it, whether it lies there)."""
    idx = label_local - v0
    inside = (idx >= 0) & (idx < v1 - v0)
    return idx.clamp(0, v1 - v0 - 1), inside


def chunk_triple(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, s, u) ``[tc]`` of a logits chunk z ``[tc,vc]`` (z is left unchanged; two chunk-sized temporaries)."""
    cm = z.amax(dim=1)  # [tc]
    d = z - cm[:, None]  # [tc,vc]
    e = d.exp()
    return cm, e.sum(dim=1), d.mul_(e).sum(dim=1)


def softmax_grad_(
    z: torch.Tensor,
    p: torch.Tensor,
    mean_z: torch.Tensor,
    g_logprob: torch.Tensor,
    g_entropy: torch.Tensor,
    idx: torch.Tensor,
    inside: torch.Tensor,
) -> torch.Tensor:
    """dL/dz ``[tc,vc]`` built in z's storage: -p (g_lp + g_ent (z - mean_z)), plus g_lp at the label.
    Without an entropy term (g_ent all 0, the usual loss) it is g_lp (1[v = y] - p), built in p's
    storage in one pass instead of five.

    p = softmax(z) over the whole vocabulary ``[tc,vc]``; (idx, inside) from the label's place
    in the chunk; per-token vectors ``[tc]`` (g_logprob already 0 for ignored labels).
    """
    if bool(g_entropy.any()):
        dz = z.sub_(mean_z[:, None]).mul_(g_entropy[:, None]).add_(g_logprob[:, None])
        dz.mul_(p).neg_()
    else:
        dz = p.mul_(-g_logprob[:, None])
    return dz.scatter_add_(1, idx[:, None], torch.where(inside, g_logprob, 0.0)[:, None])


def local_stats_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    inv_tau: float,
    chunk_tokens: int,
    chunk_vocab: int,
) -> tuple[torch.Tensor, ...]:
    """This shard's (m, s, u, label_logit), each ``[T]`` fp32, never holding more than a chunk of logits.

    hidden [T,H], weight [V_local,H] (fp32 or bf16; computed in fp32), labels [T] global ids.
    """
    num_tokens = hidden.shape[0]
    opts = {"dtype": torch.float32, "device": hidden.device}
    m = torch.full((num_tokens,), float("-inf"), **opts)
    s = torch.zeros(num_tokens, **opts)
    u = torch.zeros(num_tokens, **opts)
    label_logit = torch.zeros(num_tokens, **opts)
    label_local = labels - shard.start  # [T]
    for v0, v1 in _chunks(shard.valid, chunk_vocab):
        w_c = weight[v0:v1].float()  # [vc,H]
        for t0, t1 in _chunks(num_tokens, chunk_tokens):
            z = _scaled_logits(hidden[t0:t1].float(), w_c, inv_tau)  # [tc,vc]
            idx, inside = _label_in_chunk(label_local[t0:t1], v0, v1)
            label_logit[t0:t1] += torch.where(inside, z.gather(1, idx[:, None]).squeeze(1), 0.0)
            cm = z.amax(dim=1)  # [tc]
            d = z.sub_(cm[:, None])  # z - max, in place: [tc,vc]
            e = d.exp()
            merged = merge_stats(
                torch.stack([m[t0:t1], cm]),
                torch.stack([s[t0:t1], e.sum(dim=1)]),
                torch.stack([u[t0:t1], (e * d).sum(dim=1)]),
            )
            m[t0:t1], s[t0:t1], u[t0:t1] = merged
    return m, s, u, label_logit


def grads_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    inv_tau: float,
    lse: torch.Tensor,
    mean_z: torch.Tensor,
    g_logprob: torch.Tensor,
    g_entropy: torch.Tensor,
    chunk_tokens: int,
    chunk_vocab: int,
    need_hidden: bool = True,
    need_weight: bool = True,
    threshold: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients (dhidden [T,H] fp32, not yet reduced over TP; dweight [V_local,H] in weight's dtype).

    With p = softmax(z) over the whole (global) vocabulary, per token:
        d logprob / dz_v = 1[v = y] - p_v,     d entropy / dz_v = -p_v (z_v - mean_z),
    and dz/dx = 1/tau for x = hidden . weight^T. ``g_logprob`` must already be 0 for ignored
    labels. Padding rows of the shard get a zero gradient. ``threshold`` ``[T]`` (truncation
    replay, ``megarl.kernels.truncation``): the softmax is over ``z >= threshold`` only, p = 0 elsewhere.
    """
    num_tokens = hidden.shape[0]
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
    d_weight = torch.zeros_like(weight) if need_weight else None
    label_local = labels - shard.start
    for v0, v1 in _chunks(shard.valid, chunk_vocab):
        w_c = weight[v0:v1].float()  # [vc,H]
        dw_c = torch.zeros_like(w_c) if need_weight else None  # fp32 accumulator over token chunks
        for t0, t1 in _chunks(num_tokens, chunk_tokens):
            h_c = hidden[t0:t1].float()  # [tc,H]
            z = _scaled_logits(h_c, w_c, inv_tau)  # [tc,vc]
            p = (z - lse[t0:t1, None]).exp_()
            if threshold is not None:
                p.masked_fill_(z < threshold[t0:t1, None], 0.0)
            idx, inside = _label_in_chunk(label_local[t0:t1], v0, v1)
            rows = slice(t0, t1)
            dz = softmax_grad_(z, p, mean_z[rows], g_logprob[rows], g_entropy[rows], idx, inside)
            # dx = dz / tau: the scale rides on the gradient GEMMs
            if d_hidden is not None:
                d_hidden[t0:t1].addmm_(dz, w_c, alpha=inv_tau)
            if dw_c is not None:
                dw_c.addmm_(dz.T, h_c, alpha=inv_tau)
        if d_weight is not None:
            d_weight[v0:v1] = dw_c
    return d_hidden, d_weight


def logprobs_entropy_naive(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-device baseline that materialises the [T, V] fp32 logits; differentiable.

    ``vocab_size`` drops padded rows at the end of ``weight``. Labels outside
    ``[0, vocab_size)`` give logprob 0, as in the fused path.
    """
    vocab = weight.shape[0] if vocab_size is None else vocab_size
    logits = (hidden.float() @ weight[:vocab].float().T) / temperature  # [T,V]
    logp_all = torch.log_softmax(logits, dim=-1)
    hit = (labels >= 0) & (labels < vocab)
    logprob = logp_all.gather(1, labels.clamp(0, vocab - 1)[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return torch.where(hit, logprob, torch.zeros_like(logprob)), entropy
