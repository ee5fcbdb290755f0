"""Sequence packing: a right-padded batch → micro-batches of concatenated sequences, and back.

A batch is the trajectory format of ``megarl.api.trajectory``: ``input_ids`` and
``attention_mask`` ``[B, S]`` (right padded), other per-token tensors ``[B, S, ...]``
and per-sequence tensors ``[B, ...]``. :func:`split_by_token_budget` groups the
sequences into micro-batches of at most ``max_tokens_per_mb`` tokens (balanced
first-fit-decreasing; a longer sequence gets a micro-batch of its own);
:func:`pack` concatenates each group into one ``[T]`` stream plus ``cu_seqlens``,
padded at the end by an extra pseudo-sequence to a common length so that every
micro-batch of a call has the same shape (what Megatron's pipeline schedules and
the MoE all-gather dispatcher need). Attention never crosses ``cu_seqlens`` bounds
(see ``megarl.models.layers.SDPACoreAttention``), so a sequence gets the same
logprobs packed or alone.

Inside a micro-batch ``labels[t]`` is the next token *of the same sequence*; the
last position of each sequence has no next token and ``label_mask`` 0 there.
``cu_seqlens`` (also in ``MicroBatch.data``) delimits the sequences, the trailing
padding being one more pseudo-sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PACKED = "__packed__"


@dataclass
class MicroBatch:
    """One packed micro-batch.

    ``data`` holds every batch entry restricted to this micro-batch: per-token
    tensors packed to ``[T]`` (``[T, ...]``), per-sequence tensors ``[n, ...]``,
    other values (lists) sliced. ``T = padded_len`` includes the trailing padding.
    """

    data: dict
    seq_indices: list[int]
    """Rows of the original batch, in packing order."""
    seqlens: list[int]
    padded_len: int
    cu_seqlens: torch.Tensor = field(repr=False)
    """int32 ``[n + 1]`` (``[n + 2]`` with a padding pseudo-sequence) boundaries in the stream."""

    @property
    def num_tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens + [self.padded_len - self.num_tokens])


def split_by_token_budget(seqlens: list[int], max_tokens: int, min_groups: int = 1) -> list[list[int]]:
    """Group sequence indices into >= ``min_groups`` groups of <= ``max_tokens`` tokens where possible.

    Longest first, each into the least-filled group that has room; when none has
    room a group is added. Groups keep their indices in ascending order, groups are
    returned in order of their first index.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not seqlens:
        return []
    n_groups = max(min_groups, -(-sum(seqlens) // max_tokens))
    n_groups = min(n_groups, len(seqlens))
    while True:
        groups = _first_fit(seqlens, max_tokens, n_groups)
        if groups is not None:
            return sorted((sorted(g) for g in groups if g), key=lambda g: g[0])
        n_groups += 1


def _first_fit(seqlens: list[int], max_tokens: int, n_groups: int) -> list[list[int]] | None:
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    loads = [0] * n_groups
    for idx in sorted(range(len(seqlens)), key=lambda i: -seqlens[i]):
        order = sorted(range(n_groups), key=lambda g: loads[g])
        target = next((g for g in order if loads[g] == 0 or loads[g] + seqlens[idx] <= max_tokens), None)
        if target is None:
            return None
        groups[target].append(idx)
        loads[target] += seqlens[idx]
    return groups


def sequence_lengths(batch: dict) -> list[int]:
    """Token count of each row (``attention_mask`` sums); one host read per batch."""
    return batch["attention_mask"].sum(dim=1).tolist()


def pack(batch: dict, groups: list[list[int]], padded_len: int) -> list[MicroBatch]:
    """Pack ``groups`` of rows of ``batch`` into micro-batches of ``padded_len`` tokens each."""
    seqlens_all = sequence_lengths(batch)
    seq_dim = batch["attention_mask"].shape[1]
    n_rows = batch["attention_mask"].shape[0]
    out = []
    for rows in groups:
        lens = [seqlens_all[i] for i in rows]
        if sum(lens) > padded_len:
            raise ValueError(f"micro-batch of {sum(lens)} tokens exceeds padded length {padded_len}")
        data = {key: _pack_value(value, rows, lens, padded_len, seq_dim, n_rows) for key, value in batch.items()}
        _add_labels(data, lens, padded_len)
        data["cu_seqlens"] = _cu_seqlens(lens, padded_len)
        out.append(MicroBatch(data, list(rows), lens, padded_len, data["cu_seqlens"]))
    return out


def _pack_value(value, rows, lens, padded_len, seq_dim, n_rows):
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == n_rows and value.shape[1] == seq_dim:
        parts = [value[r, :n] for r, n in zip(rows, lens)]
        pad = padded_len - sum(lens)
        if pad:
            parts.append(torch.zeros((pad, *value.shape[2:]), dtype=value.dtype, device=value.device))
        return torch.cat(parts, dim=0)
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n_rows:
        return value[rows]
    if isinstance(value, (list, tuple)) and len(value) == n_rows:
        return [value[r] for r in rows]
    return value


def _add_labels(data: dict, lens: list[int], padded_len: int) -> None:
    ids = data["input_ids"]
    labels = torch.roll(ids, shifts=-1, dims=0)
    label_mask = torch.ones(padded_len, dtype=torch.bool, device=ids.device)
    ends = torch.tensor(lens, device=ids.device).cumsum(0) - 1
    label_mask[ends] = False
    label_mask[sum(lens):] = False
    labels = torch.where(label_mask, labels, torch.zeros_like(labels))
    data["labels"] = labels
    data["label_mask"] = label_mask


def _cu_seqlens(lens: list[int], padded_len: int) -> torch.Tensor:
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    if padded_len > bounds[-1]:
        bounds.append(padded_len)  # trailing padding attends only to itself
    return torch.tensor(bounds, dtype=torch.int32)


def unpack(values: list[torch.Tensor], mbs: list[MicroBatch], batch_size: int, seq_dim: int) -> torch.Tensor:
    """Per-token outputs ``[T, ...]`` of each micro-batch → ``[batch_size, seq_dim, ...]`` (zero padded)."""
    first = values[0]
    out = torch.zeros((batch_size, seq_dim, *first.shape[1:]), dtype=first.dtype, device=first.device)
    for value, mb in zip(values, mbs):
        start = 0
        for row, n in zip(mb.seq_indices, mb.seqlens):
            out[row, :n] = value[start : start + n]
            start += n
    return out


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
