"""Layers for the local (non-TransformerEngine) Megatron layer spec: SDPA core attention, RMSNorm.

Megatron's own ``DotProductAttention`` allocates its score buffer on ``"cuda"`` and
rejects packed sequences, and the torch-norm fallback rejects sequence parallelism.
These two small modules replace them in :func:`megarl.models.spec.layer_spec` when
TransformerEngine is absent (always on CPU):

* :class:`SDPACoreAttention` calls ``torch.nn.functional.scaled_dot_product_attention``
  (flash / memory-efficient kernels on GPU, the math kernel on CPU). Packed batches
  (Megatron's THD format, ``PackedSeqParams.cu_seqlens_q``) are attended one sequence
  at a time with ``is_causal=True``: a packed token never sees another sequence, and
  no ``T x T`` block-diagonal mask is materialised. The loop costs one host read of
  ``cu_seqlens`` per layer, the same one Megatron's THD RoPE already does. With
  :class:`SharedPrefixSeqParams` a segment may continue another (a branch after the
  prompt it shares with its group, ``megarl.actor.packing``): its queries also see every
  key of that prefix.
* :class:`RMSNorm` computes as HF's ``LlamaRMSNorm`` (fp32 statistics) and tags its
  weight for the sequence-parallel gradient all-reduce.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule


@dataclass
class SharedPrefixSeqParams(PackedSeqParams):
    """THD packing where segment ``i`` continues segment ``parents[i]`` (None: starts a sequence).

    Only :class:`SDPACoreAttention` reads ``parents``; other attention would ignore it, so
    the engine only builds these for it. RoPE positions come as the model's ``position_ids``.
    """

    parents: tuple[int | None, ...] = ()


class SDPACoreAttention(MegatronModule):
    """Causal attention through torch SDPA; drop-in for Megatron's ``core_attention`` slot."""

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
        if config.context_parallel_size != 1:
            raise ValueError(
                f"SDPACoreAttention does not support context parallelism "
                f"(context_parallel_size={config.context_parallel_size}); use TransformerEngine"
            )
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        """``query`` [s, b, np, hn] (or [t, np, hn] when packed); returns [s, b, np*hn] ([t, np*hn])."""
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention_bias")
        dropout = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            parents = getattr(packed_seq_params, "parents", ())
            return self._packed(query, key, value, packed_seq_params.cu_seqlens_q, parents, dropout)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, hn]
        out = self._sdpa(q, k, v, dropout)  # [b, np, s, hn]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _packed(self, query, key, value, cu_seqlens, parents, dropout):
        outs = []
        spans = list(itertools.pairwise(cu_seqlens.tolist()))
        for i, (start, end) in enumerate(spans):
            parent = parents[i] if parents else None
            keys = slice(start, end) if parent is None else [slice(*spans[parent]), slice(start, end)]
            q = query[start:end].transpose(0, 1).unsqueeze(0)
            k, v = (_take(x, keys).transpose(0, 1).unsqueeze(0) for x in (key, value))
            outs.append(self._sdpa(q, k, v, dropout)[0].transpose(0, 1))  # [s_i, np, hn]
        out = torch.cat(outs, dim=0)  # cu_seqlens covers every token, alignment padding included
        return out.reshape(out.shape[0], -1)

    def _sdpa(self, q, k, v, dropout):
        """[b, n, s, hn] tensors; k/v may hold fewer (grouped) heads and, before the queries' own
        keys, a prefix that every query sees (causal from the bottom-right corner)."""
        prefix = k.shape[2] - q.shape[2]
        mask = None
        if prefix:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=prefix)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=not prefix,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )


def _take(x: torch.Tensor, rows: slice | list[slice]) -> torch.Tensor:
    """Rows of ``x`` [t, ...]: one slice, or several concatenated."""
    return x[rows] if isinstance(rows, slice) else torch.cat([x[r] for r in rows], dim=0)


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
