"""The training path: a per-token loss of (logprob, entropy) over the LM head, with the gradients
of hidden and weight computed inside the forward.

``fused_logprobs_entropy`` under autograd costs 8·T·V·H FLOPs per step: 2 for the forward's
logits, 2 to recompute them in the backward, 2 + 2 for the gradient GEMMs. When the loss is a
sum of per-token terms ℓ_t(logprob_t, entropy_t) (PPO, GRPO, DAPO with token-level ratios, KL
and entropy penalties), dL/dlogprob and dL/dentropy of a token are known as soon as its softmax
statistics are, so :func:`fused_linear_token_loss` goes over the tokens in chunks and, per chunk:

1. z = h_c · Wᵀ / τ ``[tc, V_local]`` (2·tc·V·H FLOPs), kept while the chunk is processed;
2. its (max, sum exp, sum exp·(z - max), label logit), combined over the TP group with one MAX and
   one SUM all-reduce of ``[tc]`` / ``[3, tc]`` (the softmax needs the whole vocabulary before
   p_v can be formed, so the gradient GEMMs wait for them: with TP the chunk's logits stay in
   memory over the two collectives instead of being recomputed);
3. logprob and entropy, and the loss's per-token gradients g_lp, g_ent (``token_loss_fn`` under
   autograd on ``[tc]`` vectors);
4. dz = g_lp (1[v = y] - p) - g_ent p (z - E_p[z]) in z's storage, then dH_c = dz · W / τ and
   dW += dzᵀ · h_c / τ (2 + 2·tc·V·H FLOPs).

Total 6·T·V·H plus O(T·V) elementwise work, like the bare matmul's forward + backward and
Liger's fused linear cross-entropy. The backward returns the stored gradients times the incoming
scalar gradient.

Steps 1-2 and the dz of step 4 are :class:`ChunkOps`. On CUDA (``backend`` "cuda", or "auto" where
the kernels apply) they are the kernels of ``csrc/``: the fused forward in its storing variant
(one pass gives the chunk's split statistics and writes its raw fp32 logits), then
``softmax_grad.cu`` turning the stored logits into bf16 dz; the gradient GEMMs are cuBLAS. With
torch ops, steps 1-2 are an fp32 GEMM (of bf16 values on a CPU with native bf16: in
``bf16_products``, at bf16's rate) and elementwise passes; when the loss has no entropy term
(g_ent = 0 for the whole chunk) step 4's dz = g_lp (1[v = y] - p) takes one pass after p (``softmax_grad_``). Memory: the torch ops keep three
fp32 chunk buffers ``[tc, V_local]``, the kernels one fp32 and one bf16 (by default tc ≈ T·H/V_local
tokens, so one fp32 buffer is about the size of fp32 hidden states); plus the fp32 gradients dH
``[T, H]`` and dW ``[V_local, H]`` held from forward to backward (off CUDA, when no larger, the
chunks' dz ``[T, V_local]`` instead of dW, which the backward makes in one GEMM: ``_WeightGrad``),
and an fp32 copy of a non-fp32 weight off CUDA. The no-grad logprobs (``compute_logp``) keep using ``fused_logprobs_entropy``,
which never holds more than a tile of logits.

Truncation replay (``truncation=``, top-k / top-p / min-p): between steps 2 and 3 each chunk's
per-token threshold θ and truncated statistics come from a ``topk`` of its logits while they are in
memory (``truncation.truncated_stats_of_logits``: the C + 1 largest per token, one ``all_gather``
over TP, positions whose kept set the C do not hold take 4 x C from the same logits); dz then sets
p = 0 below θ (on CUDA in ``softmax_grad.cu``). No logit is computed twice: still 6·T·V·H FLOPs, plus
a ``topk`` over the chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.kernels import _cuda
from megarl.kernels._cuda import _addmm_fp32
from megarl.kernels.backend import Backend
from megarl.kernels.logprob import _check_inputs, _resolve_shard, bf16_valued, logprobs_backend, reduce_over_tp
from megarl.kernels.reference import (
    VocabShard,
    _chunks,
    _label_in_chunk,
    _scaled_logits,
    bf16_products,
    chunk_triple,
    finalize_stats,
    softmax_grad_,
)
from megarl.kernels.truncation import Truncation, truncated_stats_of_logits

TokenLossFn = Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(t0, t1, logprob [t1-t0], entropy [t1-t0]) -> per-token loss [t1-t0]`` of tokens [t0, t1).

The loss is the sum of these terms over all tokens (a mean's denominator goes into the terms).
``logprob`` and ``entropy`` are fp32 leaves requiring grad, the same on every TP rank; every
other input of the loss is a constant. Called once per chunk, in token order."""


@dataclass(frozen=True)
class ChunkOps:
    """The two steps of a token chunk that touch its ``[tc, V_local]`` logits."""

    logits_and_stats: Callable[..., tuple[torch.Tensor, ...]]
    """``(h_c, w, labels_c, shard, inv_tau) -> (logits, m, s, u, label_logit)``: the chunk's logits
    (in whatever form ``softmax_grad`` reads them back) and this shard's statistics ``[tc]``."""
    softmax_grad: Callable[..., torch.Tensor]
    """``(logits, labels_c, shard, inv_tau, lse, mean_z, g_lp, g_ent, threshold=None) -> dz``
    ``[tc, valid]``, dL/dx for the gradient GEMMs (``logits`` may be consumed); ``threshold``
    ``[tc]`` (truncation, units of z): p = 0 where z < threshold."""
    raw: bool
    """Whether ``logits`` holds the raw logits x = z · temperature (the kernels') rather than z."""


def _torch_logits_and_stats(h_c, w, labels_c, shard: VocabShard, inv_tau: float) -> tuple[torch.Tensor, ...]:
    z = _logits_f32(h_c, w, inv_tau)  # [tc,Vv]
    return z, *_local_stats(z, labels_c - shard.start)


def _torch_softmax_grad(
    z, labels_c, shard: VocabShard, inv_tau: float, lse, mean_z, g_lp, g_ent, threshold=None
) -> torch.Tensor:
    idx, inside = _label_in_chunk(labels_c - shard.start, 0, shard.valid)
    # dz is linear in (g_lp, g_ent): the 1/tau of dx = dz / tau goes on these [tc] vectors, not on dz
    g_lp, g_ent = g_lp * inv_tau, g_ent * inv_tau
    # without an entropy term or a threshold z is not read once p is formed: p takes z's storage
    z_read_again = threshold is not None or bool(g_ent.any())
    p = (z - lse[:, None]).exp_() if z_read_again else z.sub_(lse[:, None]).exp_()
    if threshold is not None:
        p.masked_fill_(z < threshold[:, None], 0.0)
    return softmax_grad_(z, p, mean_z, g_lp, g_ent, idx, inside)


CHUNK_OPS = {
    "torch": ChunkOps(_torch_logits_and_stats, _torch_softmax_grad, raw=False),
    "cuda": ChunkOps(_cuda.logits_and_stats, _cuda.softmax_grad_stored, raw=True),
}
"""The ops of each backend (tests swap in the kernels run by the host emulator)."""


@dataclass(frozen=True)
class _Spec:
    shard: VocabShard
    inv_tau: float
    tp_group: dist.ProcessGroup | None
    tp_size: int
    chunk_tokens: int
    reduce_grad_hidden: bool
    backend: str
    truncation: Truncation | None = None


MIN_CHUNK_TOKENS = 256
"""Each chunk adds into all of dW [V_local, H]: fewer tokens than this make that pass, not the GEMMs, the cost."""

GPU_CHUNK_LOGITS_BYTES = 1 << 30
"""On a GPU, the size of one chunk's fp32 logits ``[chunk_tokens, V_local]`` (the kernels hold 1.5
times this at once, the torch ops 3 times)."""


def default_chunk_tokens(num_tokens: int, vocab_local: int, hidden_size: int, on_gpu: bool = False) -> int:
    """Tokens per chunk of the training path.

    On a GPU, the most tokens whose fp32 logits fit :data:`GPU_CHUNK_LOGITS_BYTES` (a multiple of
    :data:`MIN_CHUNK_TOKENS`): each chunk reads and writes all of the fp32 dW and launches ~40
    kernels and an ``autograd.grad``, which the tensor-core GEMMs do not hide (on an H200, chunks
    of 256 tokens ran at 0.15-0.88 of the recompute path's speed). Elsewhere Liger's choice, a
    power of two near T·H/V (a chunk's logits about the size of the hidden states), at least
    :data:`MIN_CHUNK_TOKENS`: the GEMMs dominate there, and host memory is the scarcer resource."""
    if on_gpu:
        fitting = GPU_CHUNK_LOGITS_BYTES // (4 * max(vocab_local, 1))
        tokens = max(MIN_CHUNK_TOKENS, fitting // MIN_CHUNK_TOKENS * MIN_CHUNK_TOKENS)
    else:
        per_chunk = math.ceil(num_tokens / math.ceil(vocab_local / hidden_size))
        tokens = max(MIN_CHUNK_TOKENS, 2 ** math.ceil(math.log2(max(per_chunk, 1))))
    return max(1, min(num_tokens, tokens))


def _token_grads(fn: TokenLossFn, t0: int, t1: int, logprob, entropy) -> tuple[torch.Tensor, ...]:
    """(sum of the chunk's loss terms, dL/dlogprob, dL/dentropy), all detached."""
    lp = logprob.detach().requires_grad_(True)
    ent = entropy.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = fn(t0, t1, lp, ent).sum()
        grads = torch.autograd.grad(loss, (lp, ent), allow_unused=True) if loss.requires_grad else (None, None)
    g_lp, g_ent = (torch.zeros_like(lp) if g is None else g.float() for g in grads)
    return loss.detach().float(), g_lp, g_ent


def _local_stats(z: torch.Tensor, label_local: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This shard's (m, s, u, label_logit) ``[tc]`` from its logits chunk z ``[tc, Vv]``."""
    tc, valid = z.shape
    if valid == 0:  # an all-padding shard is an empty part of the vocabulary
        empty = z.new_zeros(tc)
        return empty - math.inf, empty, empty, empty
    idx, inside = _label_in_chunk(label_local, 0, valid)
    label_logit = torch.where(inside, z.gather(1, idx[:, None]).squeeze(1), 0.0)
    return *chunk_triple(z), label_logit


def _logits_f32(h_c: torch.Tensor, w: torch.Tensor, inv_tau: float) -> torch.Tensor:
    """z = h_c . w^T * inv_tau in fp32 [tc,Vv] (bf16 operands: fp32 output from cuBLAS)."""
    if h_c.dtype == torch.float32:
        return _scaled_logits(h_c, w, inv_tau)
    return torch.mm(h_c, w.T, out_dtype=torch.float32).mul_(inv_tau)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    else:
        _addmm_fp32(acc, a, b)


def _bf16_grads(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the gradient GEMMs (dH = dz·W, dW = dzᵀ·h) take bf16 operands with dz rounded to bf16:
    for bf16 hidden and weight on a GPU or on a CPU with native bf16 (AVX-512 BF16, AMX), where a bf16
    GEMM runs at 2-3x (AVX-512 BF16) or many times (AMX) fp32's rate. dz's rounding is the error of
    any bf16 backward (the model's own layers take theirs in bf16); the GEMMs still sum in fp32
    (:class:`_WeightGrad`). Without native bf16 they stay fp32: emulated bf16 is slower than fp32."""
    return bf16_valued(hidden, weight) or (hidden.is_cuda and hidden.dtype == weight.dtype == torch.bfloat16)


class _WeightGrad:
    """The head's dW = Σ_chunks dzᵀ·h_c ``[V_local, H]``, held from the forward to the backward.

    Accumulated over the token chunks in fp32; or, off CUDA, where the chunks' dz ``[T, V_local]`` in
    the gradient GEMMs' dtype is no larger than that fp32 buffer (at most 2H tokens with bf16 GEMMs,
    H with fp32 ones: an RL micro-batch's answer tokens on a small model), dz and the hidden states
    are kept and dW is one GEMM in the backward: no pass per chunk over the whole fp32 dW, no
    zeroing, scaling and casting it (on a CPU those memory-bound passes cost about what the GEMMs do)."""

    def __init__(self, weight: torch.Tensor, valid: int, hidden: torch.Tensor, dtype: torch.dtype):
        self.shape, self.valid = weight.shape, valid
        num_tokens, hidden_size = hidden.shape
        size = torch.finfo(dtype).bits // 8
        self.deferred = not hidden.is_cuda and num_tokens * size <= hidden_size * 4
        opts = {"dtype": dtype if self.deferred else torch.float32, "device": hidden.device}
        if self.deferred:
            self.dz, self.h = torch.empty(num_tokens, valid, **opts), torch.empty(num_tokens, hidden_size, **opts)
        else:
            self.acc = torch.zeros(self.shape, **opts)  # padding rows stay 0

    def add(self, t0: int, t1: int, dz: torch.Tensor, h_c: torch.Tensor) -> None:
        """The chunk of tokens [t0, t1): its dz ``[tc, valid]`` and hidden states ``[tc, H]``, in the GEMMs' dtype."""
        if self.deferred:
            self.dz[t0:t1], self.h[t0:t1] = dz, h_c
        else:
            _accumulate(self.acc[: self.valid], dz.T, h_c)  # fp32 accumulation over chunks

    def result(self, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """dW times the incoming gradient ``g`` (0-d fp32), in ``dtype``."""
        if not self.deferred:
            return (self.acc * g).to(dtype)
        out = torch.empty(self.shape, dtype=self.dz.dtype, device=self.dz.device)
        out[self.valid :].zero_()  # padding rows
        torch.mm(self.dz.T, self.h, out=out[: self.valid])
        return (out if float(g) == 1.0 else out.mul_(g)).to(dtype)


class _FusedLinearTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, token_loss_fn: TokenLossFn, spec: _Spec):
        shard, inv_tau, ops = spec.shard, spec.inv_tau, CHUNK_OPS[spec.backend]
        num_tokens = hidden.shape[0]
        # bf16 on a GPU: cuBLAS bf16 GEMMs accumulating in fp32 (dz rounded to bf16, as the CUDA
        # backward's); elsewhere the logits from fp32 GEMMs (an fp32 copy of a bf16 weight), and
        # the gradient GEMMs in bf16 where the CPU computes bf16 natively (:func:`_bf16_grads`)
        low = hidden.is_cuda and hidden.dtype == weight.dtype == torch.bfloat16
        w = weight[: shard.valid] if low else weight[: shard.valid].float()  # [Vv,H]
        grads_bf16 = _bf16_grads(hidden, weight)
        exact_bf16 = bf16_valued(hidden, weight)  # the logits GEMM at bf16's rate (fp32 copies of bf16 values)
        w_grad = weight[: shard.valid] if grads_bf16 else w  # the dH GEMM's operand
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        opts = {"dtype": torch.float32, "device": hidden.device}
        d_hidden = torch.zeros(hidden.shape, **opts) if need_hidden else None
        d_weight = _WeightGrad(weight, shard.valid, hidden, w_grad.dtype) if need_weight else None
        logprob = torch.zeros(num_tokens, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(logprob)
        loss = logprob.new_zeros(())
        hit = (labels >= 0) & (labels < shard.vocab_size)
        outside = torch.zeros_like(hit)
        for t0, t1 in _chunks(num_tokens, spec.chunk_tokens):
            h_c = hidden[t0:t1] if low else hidden[t0:t1].float()  # [tc,H]
            with bf16_products(exact_bf16):
                logits, m, s, u, label_logit = ops.logits_and_stats(h_c, w, labels[t0:t1], shard, inv_tau)
            m, s, u, label_logit = reduce_over_tp(m, s, u, label_logit, spec.tp_group, spec.tp_size)
            threshold = None
            if spec.truncation is not None:  # from the chunk's logits: a topk, no GEMM
                comm = (shard, spec.truncation, spec.tp_group, spec.tp_size)
                scale = inv_tau if ops.raw else 1.0
                m, s, u, label_logit, threshold, outside[t0:t1] = truncated_stats_of_logits(
                    logits, scale, m, s, label_logit, hit[t0:t1], *comm
                )
            lp_c, ent_c, lse, mean_z = finalize_stats(m, s, u, label_logit, hit[t0:t1])
            logprob[t0:t1], entropy[t0:t1] = lp_c, ent_c
            loss_c, g_lp, g_ent = _token_grads(token_loss_fn, t0, t1, lp_c, ent_c)
            loss += loss_c
            g_lp = torch.where(hit[t0:t1], g_lp, 0.0)  # ignored labels: logprob is a constant 0
            if shard.valid == 0:
                continue
            dz = ops.softmax_grad(logits, labels[t0:t1], shard, inv_tau, lse, mean_z, g_lp, g_ent, threshold)
            del logits
            dz = dz.to(w_grad.dtype)  # dL/dx [tc,Vv]
            if d_hidden is not None:
                _accumulate(d_hidden[t0:t1], dz, w_grad)
            if d_weight is not None:
                d_weight.add(t0, t1, dz, hidden[t0:t1] if grads_bf16 else h_c)
        if d_hidden is not None and spec.tp_size > 1 and spec.reduce_grad_hidden:
            dist.all_reduce(d_hidden, op=dist.ReduceOp.SUM, group=spec.tp_group)
        ctx.grads = (d_hidden, d_weight)  # not inputs or outputs: plain attributes
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(logprob, entropy, outside)
        return loss, logprob, entropy, outside

    @staticmethod
    def backward(ctx, g_loss, _g_logprob, _g_entropy, _g_outside):
        (d_hidden, d_weight), (hidden_dtype, weight_dtype) = ctx.grads, ctx.dtypes
        del ctx.grads  # freed with the graph's other buffers, not with ctx
        g = g_loss.float()
        d_hidden = None if d_hidden is None else (d_hidden * g).to(hidden_dtype)
        d_weight = None if d_weight is None else d_weight.result(g, weight_dtype)
        return d_hidden, d_weight, None, None, None


def fused_linear_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_loss_fn: TokenLossFn,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_grad_hidden: bool = True,
    chunk_tokens: int | None = None,
    backend: Backend = "auto",
    truncation: Truncation | None = None,
    return_outside: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Σ_t token_loss_fn(logprob_t, entropy_t), differentiable wrt hidden and weight at 6·T·V·H FLOPs.

    Args:
        hidden: ``[T, H]`` final hidden states; weight: this rank's LM-head shard ``[V_local, H]``;
            labels: ``[T]`` global token ids (outside ``[0, vocab_size)``: logprob 0, no gradient).
        token_loss_fn: the per-token loss terms (:data:`TokenLossFn`).
        tp_group, temperature, vocab_start, vocab_size, reduce_grad_hidden, backend: as
            :func:`megarl.kernels.fused_logprobs_entropy` ("cuda": the chunk's logits and dz
            from the kernels of ``csrc/``, :class:`ChunkOps`).
        chunk_tokens: tokens per chunk (default :func:`default_chunk_tokens`: on a GPU, chunks of
            about 1 GiB of fp32 logits); peak memory is three fp32 ``[chunk_tokens, V_local]``
            buffers (torch ops) or 1.5 (the kernels).
        truncation: the sampling's top-k / top-p / min-p (``megarl.kernels.truncation``): the loss of
            the truncated, renormalised softmax's logprob and entropy. Each chunk's threshold comes
            from a ``topk`` of its logits while they are in memory (one ``all_gather`` of
            candidates over TP), and dz leaves the tokens below it out (on "cuda" in the kernel).
        return_outside: also return the bool ``[T]`` of labels below their truncation threshold
            (counted; their threshold is lowered to them).

    Returns:
        (loss 0-d fp32 with the gradients attached, logprob [T], entropy [T][, outside [T]]); the
        others are detached (for statistics) and the same on every TP rank.
    """
    if hidden.dim() != 2:
        raise ValueError(f"expected hidden [T, H], got {tuple(hidden.shape)}")
    _check_inputs(hidden, weight, labels, temperature)
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    shard, tp_size = _resolve_shard(weight.shape[0], tp_group, vocab_start, vocab_size)
    tokens = chunk_tokens or default_chunk_tokens(hidden.shape[0], weight.shape[0], hidden.shape[1], hidden.is_cuda)
    spec = _Spec(
        shard,
        1.0 / temperature,
        tp_group,
        tp_size,
        tokens,
        reduce_grad_hidden,
        logprobs_backend(backend, hidden, weight),
        truncation if truncation is not None and truncation.active else None,
    )
    if truncation is not None:
        truncation.check()
    loss, logprob, entropy, outside = _FusedLinearTokenLoss.apply(hidden, weight, labels, token_loss_fn, spec)
    return (loss, logprob, entropy, outside) if return_outside else (loss, logprob, entropy)
