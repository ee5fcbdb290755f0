"""Buckets: the transfer plan cut into messages of at most ``bucket_bytes``, in a fixed order.

Both sides derive the same schedule: the trainer from the plan, the receivers from the
JSON form the trainer hands them at initialisation (:func:`receiver_spec`), so every
message's layout (which tensors, which pieces, in which order, how many elements) is
known on both ends before a byte moves and nothing but raw buckets crosses the wire.

* Broadcast: per sender (a pipeline stage, or an expert shard of one), its parameters in
  model order, cut into buckets of whole parameters (the gather unit).
* Sharded: per (sender, worker) pair, its pieces in plan order, cut into buckets;
  bucket ``k`` of every pair forms round ``k`` (one batch of point-to-point messages).

Every message is one flat buffer of the wire dtype: its items back to back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.bridge.transfer_plan import Owner, Piece, SourceParam, TransferPlan


def _cut(items: list, sizes: list[int], limit: int) -> list[list]:
    """Consecutive runs of ``items`` whose sizes sum to at most ``limit`` (an oversized item alone)."""
    buckets, current, used = [], [], 0
    for item, size in zip(items, sizes):
        if current and used + size > limit:
            buckets.append(current)
            current, used = [], 0
        current.append(item)
        used += size
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class BroadcastSchedule:
    """Senders in order, each with its buckets of source parameters."""

    senders: list[Owner]
    buckets: list[list[list[SourceParam]]]

    def entries(self, plan: TransferPlan, sender: int, bucket: int) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of each tensor of one bucket, in buffer order."""
        return [(n, plan.hf_shapes[n]) for src in self.buckets[sender][bucket] for n in src.hf_names]


def broadcast_schedule(plan: TransferPlan, bucket_numel: int) -> BroadcastSchedule:
    """Per broadcast sender, its exported parameters cut into buckets of <= ``bucket_numel`` elements."""
    senders, buckets = [], []
    for owner, params in plan.broadcast_senders().items():
        sizes = [sum(math.prod(plan.hf_shapes[n]) for n in src.hf_names) for src in params]
        senders.append(owner)
        buckets.append(_cut(params, sizes, bucket_numel))
    return BroadcastSchedule(senders, buckets)


@dataclass(frozen=True)
class ShardedSchedule:
    """Sender owners (their rank in the sharded group = index) and each pair's buckets of pieces."""

    senders: list[Owner]
    pairs: dict[tuple[int, int], list[list[Piece]]]
    """(sender index, worker index) -> buckets of pieces."""

    @property
    def rounds(self) -> int:
        return max((len(b) for b in self.pairs.values()), default=0)

    def round_messages(self, k: int) -> list[tuple[int, int, list[Piece]]]:
        """(sender, worker, pieces) of every message of round ``k``, in a fixed order."""
        return [(s, w, buckets[k]) for (s, w), buckets in sorted(self.pairs.items()) if k < len(buckets)]


def sharded_schedule(plan: TransferPlan, bucket_numel: int) -> ShardedSchedule:
    """Per (sender, worker) pair, its pieces cut into buckets of <= ``bucket_numel`` elements."""
    owners = sorted(
        {p.owner for pieces in plan.pieces.values() for p in pieces},
        key=lambda o: (o.pp, o.expert, o.ep, o.tp, o.replica),
    )
    index = {o: i for i, o in enumerate(owners)}
    per_pair: dict[tuple[int, int], list[Piece]] = {}
    for worker, pieces in sorted(plan.pieces.items()):
        for piece in pieces:
            per_pair.setdefault((index[piece.owner], worker), []).append(piece)
    pairs = {key: _cut(pieces, [p.numel for p in pieces], bucket_numel) for key, pieces in per_pair.items()}
    return ShardedSchedule(owners, pairs)


# ---------------------------------------------------------------------------------------
# what a receiver is told (JSON-friendly)
# ---------------------------------------------------------------------------------------


def sender_group_ranks(owners: list, rank_of) -> tuple[list[int], int]:
    """Group rank of each sharded-mode sender (``rank_of(owner)``: its trainer rank) and the number of sending ranks.

    A trainer rank that is several owners (a dense and an expert shard) is one group member.
    """
    ranks = sorted({rank_of(o) for o in owners})
    index = {r: i for i, r in enumerate(ranks)}
    return [index[rank_of(o)] for o in owners], len(ranks)


def receiver_spec(
    plan: TransferPlan, worker: int, mode: str, bucket_numel: int, sender_ranks: list[int] | None = None
) -> dict:
    """What worker ``worker`` must know to receive in ``mode``: its local tensors and its messages.

    ``sender_ranks`` (sharded mode): group rank of each schedule sender (:func:`sender_group_ranks`).
    """
    if mode == "broadcast":
        sched = broadcast_schedule(plan, bucket_numel)
        buckets = [
            [[[n, list(shape)] for n, shape in sched.entries(plan, s, b)] for b in range(len(bs))]
            for s, bs in enumerate(sched.buckets)
        ]
        return {"mode": mode, "senders": len(sched.senders), "buckets": buckets}
    if mode != "sharded":
        raise ValueError(f"receiver_spec: mode {mode!r} has no group schedule (broadcast or sharded)")
    sched = sharded_schedule(plan, bucket_numel)
    local = plan.local[worker]
    slot = {(t.name, t.expert): i for i, t in enumerate(local)}
    rounds = []
    for k in range(sched.rounds):
        msgs = [
            [s, [[slot[p.dest, p.expert], p.dim, p.dest_start, p.length] for p in pieces]]
            for s, w, pieces in sched.round_messages(k)
            if w == worker
        ]
        rounds.append(msgs)
    tensors = [[t.name, t.expert, list(t.shape), _padding_rows(t)] for t in local]
    if sender_ranks is None or len(sender_ranks) != len(sched.senders):
        raise ValueError(f"receiver_spec: need the group rank of each of the {len(sched.senders)} senders")
    return {
        "mode": mode,
        "senders": len(sched.senders),
        "sender_ranks": list(sender_ranks),
        "tensors": tensors,
        "rounds": rounds,
    }


def _padding_rows(tensor) -> list[list[int]]:
    """[start, stop) rows along the split dim that are padding (the receiver zero-fills them)."""
    out, offset = [], 0
    for seg in tensor.segments:
        if seg.hf is None:
            out.append([offset, offset + seg.length])
        offset += seg.length
    return out
