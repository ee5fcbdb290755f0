"""Token logprob + entropy from hidden states and a vocab-parallel LM-head shard, with autograd.

The [T, V] logits never exist: each rank reduces its shard to three numbers per token (see
``reference``), the TP group combines them with two small collectives (a MAX, then one SUM
of [3, T]), and the backward recomputes the logits chunk by chunk (torch) or tile by tile
(CUDA). Under truncation replay (``truncation``) the forward finds each token's threshold and
the truncated statistics in torch on either backend (chunked GEMMs and ``topk``, one all_gather
of candidates over TP); the backward then runs on the chosen backend with that threshold (the
CUDA kernels take it per token and leave the tokens below it out of the softmax).
The hidden-state gradient is all-reduced over the TP group here, as Megatron's
column-parallel LM head would; pass ``reduce_grad_hidden=False`` where the caller reduces it
(e.g. sequence parallelism, whose gather already reduce-scatters in backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megarl.kernels import _cuda
from megarl.kernels.backend import Backend, pick_backend
from megarl.kernels.reference import (
    VocabShard,
    bf16_products,
    finalize_stats,
    grads_chunked,
    local_stats_chunked,
    rescale_stats,
)
from megarl.kernels.truncation import Truncation, truncated_stats
from megarl.utils.hardware import cpu_bf16_native


@dataclass(frozen=True)
class _Spec:
    """Everything the autograd function needs besides tensors."""

    shard: VocabShard
    inv_tau: float
    tp_group: dist.ProcessGroup | None
    tp_size: int
    backend: Literal["cuda", "torch"]
    chunk_tokens: int
    chunk_vocab: int
    reduce_grad_hidden: bool
    truncation: Truncation | None = None


def bf16_valued(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fp32 copies the torch path makes of ``hidden`` and ``weight`` hold bf16 values on a
    CPU that multiplies bf16 natively: their logits GEMMs may then run in :func:`bf16_products`."""
    bf16 = hidden.dtype == weight.dtype == torch.bfloat16
    return bf16 and hidden.device.type == "cpu" and cpu_bf16_native()[0]


def reduce_over_tp(m, s, u, label_logit, tp_group: dist.ProcessGroup | None, tp_size: int):
    """Combine per-rank statistics [T] into global ones: all-reduce MAX of m, then one SUM of
    the rescaled (s, u) and the label logit (only the owning rank's is non-zero)."""
    if tp_size == 1:
        return m, s, u, label_logit
    m_all = m.clone()
    dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=tp_group)
    # a rank whose shard is all padding holds m = -inf and contributes zeros
    packed = torch.stack([*rescale_stats(m, s, u, m_all), label_logit])  # [3,T]
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
    return m_all, packed[0], packed[1], packed[2]


class _FusedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, spec: _Spec):
        threshold = outside = None
        if spec.truncation is not None:  # already reduced over TP
            args = (spec.shard, spec.inv_tau, spec.truncation, spec.tp_group, spec.tp_size)
            *stats, threshold, outside = truncated_stats(
                hidden, weight, labels, *args, spec.chunk_tokens, spec.chunk_vocab
            )
            m, s, u, label_logit = stats
        else:
            if spec.backend == "cuda":
                stats = _cuda.local_stats(hidden, weight, labels, spec.shard, spec.inv_tau)
            else:
                with bf16_products(bf16_valued(hidden, weight)):
                    stats = local_stats_chunked(
                        hidden, weight, labels, spec.shard, spec.inv_tau, spec.chunk_tokens, spec.chunk_vocab
                    )
            m, s, u, label_logit = reduce_over_tp(*stats, spec.tp_group, spec.tp_size)
        hit = (labels >= 0) & (labels < spec.shard.vocab_size)
        logprob, entropy, lse, mean_z = finalize_stats(m, s, u, label_logit, hit)
        ctx.save_for_backward(hidden, weight, labels, lse, mean_z, hit, threshold)
        ctx.spec = spec
        outside = torch.zeros_like(hit) if outside is None else outside
        ctx.mark_non_differentiable(outside)
        return logprob, entropy, outside

    @staticmethod
    def backward(ctx, g_logprob, g_entropy, _g_outside):
        hidden, weight, labels, lse, mean_z, hit, threshold = ctx.saved_tensors
        spec: _Spec = ctx.spec
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_logprob = torch.where(hit, g_logprob.float(), 0.0)  # ignored labels: logprob is a constant 0
        g_entropy = g_entropy.float()
        args = (hidden, weight, labels, spec.shard, spec.inv_tau, lse, mean_z, g_logprob, g_entropy)
        if spec.backend == "cuda":
            d_hidden, d_weight = _cuda.grads(*args, spec.chunk_vocab, need_hidden, need_weight, threshold=threshold)
        else:
            d_hidden, d_weight = grads_chunked(
                *args, spec.chunk_tokens, spec.chunk_vocab, need_hidden, need_weight, threshold=threshold
            )
        if d_hidden is not None:
            if spec.tp_size > 1 and spec.reduce_grad_hidden:
                dist.all_reduce(d_hidden, op=dist.ReduceOp.SUM, group=spec.tp_group)
            d_hidden = d_hidden.to(hidden.dtype)
        return d_hidden, d_weight, None, None


def _resolve_shard(
    rows: int, tp_group: dist.ProcessGroup | None, vocab_start: int | None, vocab_size: int | None
) -> tuple[VocabShard, int]:
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    start = tp_rank * rows if vocab_start is None else vocab_start
    total = rows * tp_size if vocab_size is None else vocab_size
    if start < 0 or total <= 0:
        raise ValueError(f"need vocab_start >= 0 and vocab_size > 0, got vocab_start={start}, vocab_size={total}")
    valid = min(rows, max(0, total - start))
    if valid == 0 and tp_size == 1:
        raise ValueError(f"the shard holds no real vocabulary: vocab_start={start}, vocab_size={total}")
    return VocabShard(start=start, valid=valid, vocab_size=total), tp_size


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float) -> None:
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [..., H] and weight [V_local, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal hidden's leading dims {tuple(hidden.shape[:-1])}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if not (hidden.dtype.is_floating_point and weight.dtype.is_floating_point):
        raise ValueError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(f"devices differ: hidden {hidden.device}, weight {weight.device}, labels {labels.device}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")


def logprobs_backend(backend: Backend, hidden: torch.Tensor, weight: torch.Tensor) -> Literal["cuda", "torch"]:
    """The implementation :func:`fused_logprobs_entropy` runs for these operands under ``backend``."""
    needs = (
        "CUDA bf16 hidden/weight with H % 8 == 0, a loadable megarl._C and a mainloop that passes "
        "its self-check (see the warning logged); got "
        f"{hidden.device} {hidden.dtype}/{weight.dtype}, H={hidden.shape[-1]}"
    )
    return pick_backend(backend, lambda: _cuda.supports(hidden, weight), needs)


def fused_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_grad_hidden: bool = True,
    backend: Backend = "auto",
    chunk_tokens: int = 1024,
    chunk_vocab: int = 4096,
    truncation: Truncation | None = None,
    return_outside: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Log-probability of each label and entropy of each token's softmax, at ``temperature``.

    Args:
        hidden: final hidden states ``[..., H]`` (bf16 or fp32; computed with fp32 accumulation).
        weight: this rank's LM-head shard ``[V_local, H]``; its rows may end in padding.
        labels: global token ids ``[...]``; ids outside ``[0, vocab_size)`` (e.g. -100) give
            logprob 0 with no gradient.
        tp_group: the tensor-parallel group the vocabulary is split over (None: one rank).
        temperature: logits are divided by it before the softmax.
        vocab_start: global id of the shard's first row (default ``tp_rank * V_local``).
        vocab_size: real global vocabulary size (default ``V_local * tp_size``: no padding).
        reduce_grad_hidden: all-reduce the hidden gradient over ``tp_group`` in backward.
        backend: "cuda" (fused kernels), "torch" (chunked reference) or "auto".
        chunk_tokens, chunk_vocab: chunk sizes of the torch path (peak memory is
            O(chunk_tokens x chunk_vocab)); ``chunk_vocab`` is also the backward's dz chunk on CUDA.
        truncation: the sampling's top-k / top-p / min-p (``megarl.kernels.truncation``): logprob
            and entropy of the truncated, renormalised softmax. The forward finds the per-token
            threshold in torch (chunked, never the full logits) on both backends; the backward
            runs on ``backend`` with it (on "cuda" the kernels mask the tokens below it).
        return_outside: also return the bool mask of labels that fell below their truncation
            threshold (counted; their threshold is lowered to them).

    Returns:
        (logprobs, entropy[, outside]), fp32, shaped like ``labels``; the same on every TP rank.
    """
    _check_inputs(hidden, weight, labels, temperature)
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError(f"chunk sizes must be >= 1, got chunk_tokens={chunk_tokens}, chunk_vocab={chunk_vocab}")
    shard, tp_size = _resolve_shard(weight.shape[0], tp_group, vocab_start, vocab_size)
    spec = _Spec(
        shard=shard,
        inv_tau=1.0 / temperature,
        tp_group=tp_group,
        tp_size=tp_size,
        backend=logprobs_backend(backend, hidden, weight),
        chunk_tokens=chunk_tokens,
        chunk_vocab=chunk_vocab,
        reduce_grad_hidden=reduce_grad_hidden,
        truncation=truncation if truncation is not None and truncation.active else None,
    )
    if truncation is not None:
        truncation.check()
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    logprob, entropy, outside = _FusedLogprobEntropy.apply(flat_hidden, weight, flat_labels, spec)
    out = (logprob.view(labels.shape), entropy.view(labels.shape))
    return (*out, outside.view(labels.shape)) if return_outside else out
