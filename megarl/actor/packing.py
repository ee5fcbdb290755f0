"""Sequence packing: a right-padded batch → micro-batches of concatenated sequences, and back.

A batch is the trajectory format of ``megarl.api.trajectory``: ``input_ids`` and
``attention_mask`` ``[B, S]`` (right padded), other per-token tensors ``[B, S, ...]``
and per-sequence tensors ``[B, ...]``.

1. :func:`pack_units` cuts the rows into *units*, what a micro-batch holds whole. A unit is
   one row, or — with ``share_prefix`` — several rows that start with the same tokens (a
   GRPO group: one prompt, ``n_samples`` answers). Their common prefix is packed once and
   each row continues it as a *branch*: 8 answers of 15 tokens to a 45-token prompt pack
   into about 180 tokens instead of 480.
2. :func:`split_by_token_budget` groups units into micro-batches of at most
   ``max_tokens_per_mb`` tokens (balanced first-fit-decreasing; a longer unit gets a
   micro-batch of its own).
3. :func:`pack` concatenates each group into one ``[T]`` stream of :class:`Segment` s plus
   ``cu_seqlens``, padded at the end by an extra pseudo-sequence to a common length so that
   every micro-batch of a call has the same shape (what Megatron's pipeline schedules and the
   MoE all-gather dispatcher need).

Attention never crosses segment bounds, except that a branch also sees its prefix (see
``megarl.models.layers.SDPACoreAttention``), and ``position_ids`` give every token its
column in its row: a sequence gets the same logprobs packed, shared or alone.

Inside a micro-batch ``labels[t]`` is the next token *of the same row*; the last position
of each row has no next token and ``label_mask`` 0 there. A shared prefix stops before the
rows' last common token and two tokens before their first scored one, so its labels are the
same for every row it stands for and no loss ever counts one of its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from megarl.actor.context_parallel import ContextSplit


@dataclass(frozen=True)
class Segment:
    """Packed tokens that are columns ``[start, end)`` of batch row(s) ``rows``.

    A plain sequence or a branch has one row; a shared prefix lists every row it stands
    for; the trailing padding has none. ``parent`` is the index (in the micro-batch) of
    the prefix segment a branch continues, else None.
    """

    rows: tuple[int, ...]
    start: int
    end: int
    parent: int | None = None

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Unit:
    """Rows packed together: ``shared`` leading tokens once, then each row's remainder."""

    rows: tuple[int, ...]
    shared: int = 0

    def num_tokens(self, seqlens: list[int]) -> int:
        return self.shared + sum(seqlens[r] - self.shared for r in self.rows)

    def segments(self, seqlens: list[int], first_index: int) -> list[Segment]:
        """This unit's segments; ``first_index`` is the index the first one gets in its micro-batch."""
        if not self.shared:
            return [Segment((r,), 0, seqlens[r]) for r in self.rows]
        prefix = Segment(self.rows, 0, self.shared)
        return [prefix] + [Segment((r,), self.shared, seqlens[r], parent=first_index) for r in self.rows]


@dataclass
class MicroBatch:
    """One packed micro-batch.

    ``data`` holds every batch entry restricted to this micro-batch: per-token
    tensors packed to ``[T]`` (``[T, ...]``), per-sequence tensors ``[n, ...]`` (rows
    in ``seq_indices`` order), other values (lists) sliced; plus ``labels``,
    ``label_mask``, ``position_ids`` and ``cu_seqlens``. ``T = padded_len`` includes the
    trailing padding.
    """

    data: dict
    seq_indices: list[int]
    """Rows of the original batch, in packing order."""
    segments: list[Segment]
    padded_len: int
    cu_seqlens: torch.Tensor = field(repr=False)
    """int32 segment boundaries in the stream (the trailing padding is one more segment)."""
    context: ContextSplit | None = field(default=None, repr=False)
    """With context parallelism, how the model's input is split over the context-parallel ranks
    (``megarl.actor.context_parallel``); ``data`` stays the whole stream."""

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments if s.rows)

    @property
    def max_seqlen(self) -> int:
        """Longest segment and largest position + 1 (what RoPE tables must cover)."""
        return max(max(s.end, s.length) for s in self.segments)

    @property
    def shares_prefixes(self) -> bool:
        return any(s.parent is not None for s in self.segments)

    @property
    def parents(self) -> tuple[int | None, ...]:
        return tuple(s.parent for s in self.segments)


class MicroBatchHook(Protocol):
    """What the engine tells around each model chunk's forward on a packed micro-batch (e.g. the MoE
    routing meter and replay of :mod:`megarl.actor.moe_routing`): ``mb.data`` is on the model's device
    (the whole packed stream; under context parallelism the model sees ``mb.context``'s part of it)."""

    def before_forward(self, chunk, mb: MicroBatch) -> None: ...

    def after_forward(self, chunk, mb: MicroBatch) -> None: ...


def sequence_lengths(batch: dict) -> list[int]:
    """Token count of each row (``attention_mask`` sums); one host read per batch."""
    return batch["attention_mask"].sum(dim=1).tolist()


def pack_units(batch: dict, max_tokens: int, share_prefix: bool) -> list[Unit]:
    """The rows of ``batch`` as units, in row order (see the module docstring).

    With ``share_prefix``, rows whose tokens agree up to their first scored token
    (``loss_mask``) share those tokens but one; a group is cut into several units when
    it would exceed ``max_tokens``. Without ``loss_mask`` in the batch nothing is shared.
    """
    seqlens = sequence_lengths(batch)
    if not share_prefix or "loss_mask" not in batch:
        return [Unit((r,)) for r in range(len(seqlens))]
    ids = batch["input_ids"]
    first_scored = _first_scored(batch["loss_mask"], seqlens)
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, n in enumerate(first_scored):
        groups.setdefault(tuple(ids[r, :n].tolist()), []).append(r)
    units = []
    for rows in groups.values():
        shared = _shared_length(ids, rows, seqlens, first_scored)
        units += _chunk(rows, shared, seqlens, max_tokens)
    return sorted(units, key=lambda u: u.rows[0])


def _first_scored(loss_mask: torch.Tensor, seqlens: list[int]) -> list[int]:
    scored = loss_mask.bool()
    first = torch.where(scored.any(dim=1), scored.int().argmax(dim=1), torch.tensor(seqlens))
    return first.tolist()


def _shared_length(ids: torch.Tensor, rows: list[int], seqlens: list[int], first_scored: list[int]) -> int:
    """How many leading tokens ``rows`` can share.

    The last common token stays in the branches (its label may differ between rows), and
    so does the token before the first scored one: then neither the token's nor its next
    token's ``loss_mask`` is set in the prefix, whichever alignment the batch is in (the
    rollout's, or next-token after ``compute_advantages``), and no loss counts a shared
    token once for several rows.
    """
    if len(rows) < 2:
        return 0
    width = min(seqlens[r] for r in rows)
    block = ids[rows, :width]
    differs = (block != block[:1]).any(dim=0)
    common = int(differs.int().argmax()) if bool(differs.any()) else width
    return max(0, min(common, min(first_scored[r] for r in rows), width) - 1)


def _chunk(rows: list[int], shared: int, seqlens: list[int], max_tokens: int) -> list[Unit]:
    """``rows`` sharing ``shared`` tokens as units of at most ``max_tokens`` (one row at least)."""
    if not shared:
        return [Unit((r,)) for r in rows]
    units, current, cost = [], [], shared
    for r in rows:
        extra = seqlens[r] - shared
        if current and cost + extra > max_tokens:
            units.append(current)
            current, cost = [], shared
        current.append(r)
        cost += extra
    units.append(current)
    return [Unit(tuple(u), shared) if len(u) > 1 else Unit(tuple(u)) for u in units]


def split_by_token_budget(seqlens: list[int], max_tokens: int, min_groups: int = 1) -> list[list[int]]:
    """Group item indices (``seqlens``: tokens per item) into >= ``min_groups`` groups of <= ``max_tokens``.

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


def pack(batch: dict, groups: list[list[int | Unit]], padded_len: int) -> list[MicroBatch]:
    """Pack ``groups`` of units (or plain row indices) of ``batch`` into micro-batches of ``padded_len`` tokens."""
    seqlens = sequence_lengths(batch)
    seq_dim = batch["attention_mask"].shape[1]
    n_rows = batch["attention_mask"].shape[0]
    out = []
    for group in groups:
        units = [u if isinstance(u, Unit) else Unit((u,)) for u in group]
        segments: list[Segment] = []
        for unit in units:
            segments += unit.segments(seqlens, len(segments))
        used = sum(s.length for s in segments)
        if used > padded_len:
            raise ValueError(f"micro-batch of {used} tokens exceeds padded length {padded_len}")
        if padded_len > used:
            segments.append(Segment((), 0, padded_len - used))  # trailing padding attends only to itself
        rows = [r for u in units for r in u.rows]
        data = {key: _pack_value(value, rows, segments, seq_dim, n_rows) for key, value in batch.items()}
        data["position_ids"] = torch.cat([torch.arange(s.start, s.end) for s in segments])
        _add_labels(data, batch["input_ids"], segments, seqlens)
        data["cu_seqlens"] = _cu_seqlens(segments)
        out.append(MicroBatch(data, rows, segments, padded_len, data["cu_seqlens"]))
    return out


def _pack_value(value, rows, segments, seq_dim, n_rows):
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == n_rows and value.shape[1] == seq_dim:
        parts = [
            value[s.rows[0], s.start : s.end]
            if s.rows
            else torch.zeros((s.length, *value.shape[2:]), dtype=value.dtype, device=value.device)
            for s in segments
        ]
        return torch.cat(parts, dim=0)
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n_rows:
        return value[rows]
    if isinstance(value, (list, tuple)) and len(value) == n_rows:
        return [value[r] for r in rows]
    return value


def _add_labels(data: dict, input_ids: torch.Tensor, segments: list[Segment], seqlens: list[int]) -> None:
    """``labels[t]``: the token after ``t`` in its row (``position_ids`` + 1); ``label_mask`` False where there is none."""
    row = torch.cat([torch.full((s.length,), s.rows[0] if s.rows else -1) for s in segments])
    nxt = data["position_ids"] + 1
    label_mask = ((row >= 0) & (nxt < torch.tensor(seqlens + [0])[row])).to(input_ids.device)  # padding: row -1
    labels = input_ids[row.clamp(min=0), nxt.clamp(max=input_ids.shape[1] - 1)]
    data["labels"] = torch.where(label_mask, labels, torch.zeros_like(labels))
    data["label_mask"] = label_mask


def _cu_seqlens(segments: list[Segment]) -> torch.Tensor:
    bounds = [0]
    for s in segments:
        bounds.append(bounds[-1] + s.length)
    return torch.tensor(bounds, dtype=torch.int32)


def unpack(values: list[torch.Tensor], mbs: list[MicroBatch], batch_size: int, seq_dim: int) -> torch.Tensor:
    """Per-token outputs ``[T, ...]`` of each micro-batch → ``[batch_size, seq_dim, ...]`` (zero padded).

    A shared prefix's outputs go to every row it stands for.
    """
    first = values[0]
    out = torch.zeros((batch_size, seq_dim, *first.shape[1:]), dtype=first.dtype, device=first.device)
    for value, mb in zip(values, mbs):
        offset = 0
        for s in mb.segments:
            for row in s.rows:
                out[row, s.start : s.end] = value[offset : offset + s.length]
            offset += s.length
    return out


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
