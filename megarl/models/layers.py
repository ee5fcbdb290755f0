"""Layers for the local (non-TransformerEngine) Megatron layer spec: SDPA core attention, RMSNorm.

Megatron's own ``DotProductAttention`` allocates its score buffer on ``"cuda"`` and
rejects packed sequences, and the torch-norm fallback rejects sequence parallelism.
These two small modules replace them in :func:`megarl.models.spec.layer_spec` when
TransformerEngine is absent (always on CPU):

* :class:`SDPACoreAttention` calls ``torch.nn.functional.scaled_dot_product_attention``
  (flash / memory-efficient kernels on GPU, the flash kernel for CPU on CPU; on CPU rows of few
  keys are two batched GEMMs and a softmax instead, :func:`grouped_math_attention`). Packed batches
  (Megatron's THD format, ``PackedSeqParams.cu_seqlens_q``) are attended as a few padded
  batches (:class:`PaddedAttentionPlan`): the segments, sorted into buckets of similar
  length, are gathered into right-padded ``[b, n, s, hn]`` rows and attended causally in one
  call per bucket, so a packed token never sees another sequence, no ``T x T``
  block-diagonal mask is materialised, and an RL batch of many short answers costs a few
  kernel calls per layer instead of one per sequence (in bf16 on CPU, one call per sequence
  made the attention backward the largest single cost of the train phase). The plan is
  computed once per micro-batch (one host read of ``cu_seqlens``, the same one Megatron's
  THD RoPE already does) and kept on the ``PackedSeqParams`` every layer shares. With
  :class:`SharedPrefixSeqParams` a segment may continue another (a branch after the
  prompt it shares with its group, ``megarl.actor.packing``): its queries also see every
  key of that prefix. A layer with a sliding window (Mistral's ``sliding_window``: Megatron's
  ``window_size``) masks, in the rows longer than the window, the keys a query no longer sees.
  Under context parallelism a rank holds two chunks of each segment (:func:`context_chunks`):
  it all-gathers the keys and values of the group and attends its own queries to them, each
  masked by its position (``megarl.actor.context_parallel``).
* :class:`RMSNorm` computes as HF's ``LlamaRMSNorm`` (fp32 statistics) and tags its
  weight for the sequence-parallel gradient all-reduce.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention


@dataclass
class SharedPrefixSeqParams(PackedSeqParams):
    """THD packing where segment ``i`` continues segment ``parents[i]`` (None: starts a sequence).

    Only :class:`SDPACoreAttention` reads ``parents``; other attention would ignore it, so
    the engine only builds these for it. RoPE positions come as the model's ``position_ids``.
    """

    parents: tuple[int | None, ...] = ()


CPU_ATTENTION_IN_FP32 = True
"""Attend in fp32 on CPU when the model computes in bf16 or fp16. torch's CPU flash-attention kernel
is slow in bf16 for the short sequences of RL (its bf16 backward took 1.06 s of a 5.5 s train phase
where fp32's took 0.20 s, ``benchmarks/results/train_phase_amx.md``), and the attention's matrices are
small next to the linear layers' at these lengths, so the casts cost less than they save; fp32 is also
the more exact of the two."""

CPU_MATH_ATTENTION_MAX_KEYS = 128
"""On CPU, rows of at most this many keys are attended as two batched GEMMs and a softmax
(:func:`grouped_math_attention`) instead of torch's flash kernel, whose fixed work per row and head
costs more than the arithmetic at the lengths of short RL answers: fp32, 9 query and 3 KV heads of
64, forward and backward of one layer, 8.2 against 15.2 ms for 64 rows of 16 queries over 56 keys
(the arithmetic job's answers) and 1.7 against 2.8 ms for 8 prompts of 40; level at 32 rows of 64
over 160 and 16 of 128 over 256, slower beyond. The probabilities are kept for the backward: at
most this many fp32 values per query and head, beside the flash kernel's one."""


class SDPACoreAttention(MegatronModule):
    """Causal attention through torch SDPA (short rows on CPU: :func:`grouped_math_attention`); drop-in
    for Megatron's ``core_attention`` slot."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.cp_group = None
        if config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window = layer_window(config, layer_number)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        """``query`` [s, b, np, hn] (or [t, np, hn] when packed); returns [s, b, np*hn] ([t, np*hn])."""
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention_bias")
        dropout = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, dropout)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, hn]
        out = self._sdpa(q, k, v, dropout, plain_mask(q.shape[2], self.window, q.device))  # [b, np, s, hn]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _packed(self, query, key, value, params, dropout):
        context = None
        if self.cp_group is not None:  # this rank's chunks of every sequence: all keys and values from all
            context = (self.cp_group.size(), self.cp_group.rank())
            key, value = (_gather_context(x, params, self.cp_group) for x in (key, value))
        plan = PaddedAttentionPlan.of(params, query.device, self.window, context)
        outs = []
        for bucket in plan.buckets:
            q = _gather(query, bucket.query_rows)  # [b, np, s, hn]
            k, v = (_gather(x, bucket.key_rows) for x in (key, value))
            out = self._sdpa(q, k, v, dropout, bucket.mask, bucket.biases)  # [b, np, s, hn]
            outs.append(out.transpose(1, 2).reshape(-1, out.shape[1] * out.shape[3]))
        return torch.cat(outs, dim=0).index_select(0, plan.token_rows)  # back to the packed order

    def _sdpa(self, q, k, v, dropout, mask: torch.Tensor | None, biases: dict | None = None):
        """[b, n, s, hn] tensors; k/v may hold fewer (grouped) heads. ``mask``: which keys each query sees
        (a row with a prefix, or longer than the sliding window), ``[b, 1, s_q, s_k]`` per packed row or
        ``[s_q, s_k]`` for every row alike; None: causal.
        ``biases``: where the math path's additive masks are kept from one layer to the next.

        On CPU a bf16 / fp16 attention runs in fp32 (:data:`CPU_ATTENTION_IN_FP32`) and its output is
        cast back; rows of few keys take :func:`grouped_math_attention` (:data:`CPU_MATH_ATTENTION_MAX_KEYS`)."""
        dtype = q.dtype
        if CPU_ATTENTION_IN_FP32 and q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            q, k, v = q.float(), k.float(), v.float()
        if q.device.type == "cpu" and dropout == 0.0 and k.shape[2] <= CPU_MATH_ATTENTION_MAX_KEYS:
            scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
            return grouped_math_attention(q, k, v, _math_bias(mask, q, k, biases), scale).to(dtype)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=mask is None,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return out.to(dtype)


def grouped_math_attention(q, k, v, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale + bias)·v for q ``[b, n, s, hn]`` and k, v ``[b, n_kv, s_k, hn]``, as two
    batched GEMMs: the ``g = n / n_kv`` query heads of each KV head are stacked as the rows of one
    GEMM (head ``h`` reads KV head ``h // g``, as SDPA's ``enable_gqa``), so keys are never repeated.
    ``bias`` (0 where a query sees a key, -inf elsewhere) is ``[b * n_kv, g * s, s_k]`` or broadcasts
    to it (:func:`causal_bias`, :meth:`PaddedBucket.bias`). Every query must see at least one key."""
    b, n, s, hn = q.shape
    n_kv, s_k = k.shape[1], k.shape[2]
    rows = q.reshape(b * n_kv, n // n_kv * s, hn)
    scores = torch.baddbmm(bias, rows, k.reshape(b * n_kv, s_k, hn).transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(-1), v.reshape(b * n_kv, s_k, hn)).view(b, n, s, hn)


def _math_bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, biases: dict | None) -> torch.Tensor:
    """:func:`grouped_math_attention`'s additive mask (causal where ``mask`` is None), kept in ``biases``
    (a bucket's, shared by every layer) when given."""
    kv_heads, groups = k.shape[1], q.shape[1] // k.shape[1]
    key = (kv_heads, groups, q.dtype)
    if biases is not None and key in biases:
        return biases[key]
    if mask is None:
        bias = causal_bias(q.shape[2], groups, q.dtype, q.device)
    elif mask.dim() == 2:  # [s_q, s_k], every row alike
        bias = _additive(mask).to(q.dtype).repeat(groups, 1)
    else:  # [b, 1, s_q, s_k]: the same for each head of a row
        b, _, s_q, s_k = mask.shape
        rows = _additive(mask[:, None]).to(q.dtype).expand(b, kv_heads, groups, s_q, s_k)
        bias = rows.reshape(b * kv_heads, groups * s_q, s_k)
    if biases is not None:
        biases[key] = bias
    return bias


def causal_bias(s: int, groups: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The additive causal mask ``[groups * s, s]`` of :func:`grouped_math_attention` (query ``i`` sees keys ``<= i``)."""
    visible = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    return _additive(visible).to(dtype).repeat(groups, 1)


def _additive(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def context_chunks(length: int, cp: int, rank: int) -> tuple[range, range]:
    """The positions of a sequence of ``length`` tokens (a multiple of ``2 * cp``) that context-parallel
    rank ``rank`` holds: chunks ``rank`` and ``2 * cp - 1 - rank`` of its ``2 * cp`` equal chunks, the
    load-balanced split of Megatron-Core and TransformerEngine (every rank gets as many early queries,
    which see few keys, as late ones)."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x {cp} context-parallel chunks")
    c = length // (2 * cp)
    return range(rank * c, (rank + 1) * c), range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)


def context_positions(cu_seqlens: list[int], cp: int, rank: int) -> list[int]:
    """Where in the packed stream (``cu_seqlens``: every segment a multiple of ``2 * cp``) each token
    that context-parallel rank ``rank`` holds sits, in the rank's order: segment by segment, its two
    chunks (:func:`context_chunks`)."""
    out = []
    for start, end in itertools.pairwise(cu_seqlens):
        for chunk in context_chunks(end - start, cp, rank):
            out += [start + i for i in chunk]
    return out


def _gather_context(x: torch.Tensor, params: PackedSeqParams, group) -> torch.Tensor:
    """Every context-parallel rank's tokens of ``x`` [t, n, hn], in the packed stream's order; the backward
    sums each token's gradient over the ranks whose queries saw it and hands it to the rank that holds it."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    order = params.__dict__.get("_megarl_context_order")
    if order is None:
        cu, cp = params.cu_seqlens_q.tolist(), group.size()
        ranks = [p for r in range(cp) for p in context_positions(cu, cp, r)]  # gathered row -> stream position
        order = torch.empty(len(ranks), dtype=torch.long)
        order[torch.tensor(ranks)] = torch.arange(len(ranks))
        order = params.__dict__.setdefault("_megarl_context_order", order.to(x.device))
    full = gather_from_sequence_parallel_region(x.contiguous(), tensor_parallel_output_grad=True, group=group)
    return full.index_select(0, order)


def _gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` [b, s] of ``x`` [t, n, hn] as a padded batch [b, n, s, hn]."""
    b, s = rows.shape
    return x.index_select(0, rows.flatten()).view(b, s, *x.shape[1:]).transpose(1, 2)


@dataclass
class PaddedBucket:
    """Segments of similar length attended together: ``query_rows`` [b, s_q] and ``key_rows``
    [b, s_k] index the packed tokens (padding points at token 0, its outputs are dropped);
    ``mask`` [b, 1, s_q, s_k] where a row has a prefix, is longer than the sliding window or holds a
    context-parallel rank's chunks, else None (plain causal); ``biases``: the math path's additive
    masks, made on the first layer and kept for the others."""

    query_rows: torch.Tensor
    key_rows: torch.Tensor
    mask: torch.Tensor | None
    biases: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class PaddedAttentionPlan:
    """How a packed micro-batch is attended as padded batches; ``token_rows`` [t] maps each packed
    token to its row in the buckets' outputs, concatenated."""

    buckets: list[PaddedBucket]
    token_rows: torch.Tensor

    GROWTH = 1.25
    """A bucket takes segments whose key length is at most this times its shortest one's, so the
    padding costs at most ~1.25x the attention work of the segments it holds."""

    @classmethod
    def of(
        cls, params: PackedSeqParams, device, window: int | None = None, context: tuple[int, int] | None = None
    ) -> PaddedAttentionPlan:
        """The plan of ``params`` for layers of sliding ``window`` (None: none), computed on the first
        such layer and kept on ``params`` for the others. ``context``: (size, rank) of context parallelism
        (:meth:`build`)."""
        plans = params.__dict__.setdefault("_megarl_attention_plans", {})
        if window not in plans:
            cu = params.cu_seqlens_q.tolist()
            plans[window] = cls.build(cu, getattr(params, "parents", ()), device, window, context)
        return plans[window]

    @classmethod
    def build(
        cls,
        cu_seqlens: list[int],
        parents: tuple,
        device,
        window: int | None = None,
        context: tuple[int, int] | None = None,
    ) -> PaddedAttentionPlan:
        """Without ``context``, the queries are the packed tokens and the keys the same tokens. With
        ``context`` (size, rank), the queries are the tokens this rank holds (:func:`context_positions`)
        and the keys every rank's, gathered into the stream's order."""
        rows = _context_rows(cu_seqlens, *context) if context else _packed_rows(cu_seqlens, parents)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].keys))
        buckets, row_base = [], 0
        token_rows = torch.empty(sum(len(row.queries) for row in rows), dtype=torch.long)
        while order:
            first_len = len(rows[order[0]].keys)
            take = [i for i in order if len(rows[i].keys) <= first_len * cls.GROWTH]
            order = order[len(take) :]
            bucket = cls._bucket([rows[i] for i in take], device, window)
            width = bucket.query_rows.shape[1]
            for slot, i in enumerate(take):
                queries = rows[i].queries
                token_rows[queries] = torch.arange(len(queries)) + row_base + slot * width
            row_base += len(take) * width
            buckets.append(bucket)
        return cls(buckets, token_rows.to(device))

    @staticmethod
    def _bucket(rows: list[AttentionRow], device, window: int | None) -> PaddedBucket:
        s_q = max(len(row.queries) for row in rows)
        s_k = max(len(row.keys) for row in rows)
        query_rows = torch.zeros(len(rows), s_q, dtype=torch.long)
        key_rows = torch.zeros(len(rows), s_k, dtype=torch.long)
        # a padding query sees what the row's last key sees (a query of no key would make NaNs)
        position = torch.zeros(len(rows), s_q, dtype=torch.long)
        for slot, row in enumerate(rows):
            query_rows[slot, : len(row.queries)] = row.queries
            key_rows[slot, : len(row.keys)] = row.keys
            position[slot] = len(row.keys) - 1
            position[slot, : len(row.queries)] = row.positions
        mask = None
        if not all(row.causal for row in rows) or (window is not None and s_k > window):
            # a query sees the keys of its row up to its position, in the window
            mask = visible_keys(position, s_k, window).unsqueeze(1).to(device)
        return PaddedBucket(query_rows.to(device), key_rows.to(device), mask)


@dataclass(frozen=True)
class AttentionRow:
    """One padded row of a :class:`PaddedAttentionPlan`: its queries (rows of the query tensor), each
    query's position among the row's keys, and the keys (rows of the key tensor, in position order),
    all int64 ``[n]``. ``causal``: query ``i`` is at position ``i`` (plain causal attention needs no mask)."""

    queries: torch.Tensor
    positions: torch.Tensor
    keys: torch.Tensor
    causal: bool


def _packed_rows(cu_seqlens: list[int], parents: tuple) -> list[AttentionRow]:
    """A row per segment; a branch's keys start with its prefix's (its queries' positions after them)."""
    spans = list(itertools.pairwise(cu_seqlens))
    rows = []
    for i, (start, end) in enumerate(spans):
        parent = parents[i] if parents else None
        own = torch.arange(start, end)
        prefix = torch.arange(*spans[parent]) if parent is not None else own[:0]
        positions = torch.arange(len(prefix), len(prefix) + end - start)
        rows.append(AttentionRow(own, positions, torch.cat([prefix, own]), causal=parent is None))
    return rows


def _context_rows(cu_seqlens: list[int], cp: int, rank: int) -> list[AttentionRow]:
    """A row per segment: this rank's two chunks of it as queries, the whole segment as keys."""
    rows, local = [], 0
    for start, end in itertools.pairwise(cu_seqlens):
        positions = torch.cat(
            [torch.arange(chunk.start, chunk.stop) for chunk in context_chunks(end - start, cp, rank)]
        )
        queries = torch.arange(local, local + len(positions))
        rows.append(AttentionRow(queries, positions, torch.arange(start, end), causal=False))
        local += len(positions)
    return rows


def visible_keys(position: torch.Tensor, s_k: int, window: int | None) -> torch.Tensor:
    """Which of keys ``0 .. s_k - 1`` (a row's positions) each query at ``position`` sees: those at or
    before it and, with a sliding ``window``, after ``position - window`` (HF's rule). ``[..., s_k]``."""
    keys = torch.arange(s_k, device=position.device)
    visible = keys <= position[..., None]
    if window is not None:
        visible &= keys > position[..., None] - window
    return visible


def plain_mask(s: int, window: int | None, device) -> torch.Tensor | None:
    """The ``[s, s]`` mask of an unpacked batch's rows where the sliding ``window`` is shorter than
    them; None where causal attention is the same."""
    if window is None or s <= window:
        return None
    return visible_keys(torch.arange(s, device=device), s, window)


def layer_window(config, layer_number: int) -> int | None:
    """The sliding window of layer ``layer_number`` (1-based, across pipeline stages) under Megatron's
    ``window_size`` / ``window_attn_skip_freq`` (set from the HF config by ``megarl.models.build``), None: none."""
    window_size = getattr(config, "window_size", None)
    if not is_layer_window_attention(window_size, getattr(config, "window_attn_skip_freq", None), layer_number):
        return None
    before, after = window_size
    if after != 0 or before < 0:
        raise ValueError(f"window_size {tuple(window_size)}: only causal windows (N, 0) are supported")
    return before + 1


class RMSNorm(torch.nn.Module):
    """RMSNorm with HF numerics; its weight joins Megatron's sequence-parallel grad all-reduce."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # finalize_model_grads all-reduces grads of params carrying this flag over TP.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        h32 = hidden.float()
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h32.to(dtype)
