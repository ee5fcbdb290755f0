"""Per-sequence reductions over packed token tensors (``cu_seqlens`` holds each sequence's start)."""

from __future__ import annotations

import torch


def sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T] index of the sequence each packed token belongs to."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] sum of ``values`` [T] over each sequence."""
    seq = sequence_ids(cu_seqlens, values.numel())
    out = torch.zeros(len(cu_seqlens) - 1, dtype=values.dtype, device=values.device)
    return out.index_add(0, seq, values)
