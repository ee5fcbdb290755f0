"""Sharded mode: each inference worker receives only its own slices, from the ranks holding them.

No gather: a trainer rank sends, straight from its local Megatron shard, the runs of
rows that overlap each worker's local tensors (fused QKV, gate/up and experts included,
per the plan's :class:`~megarl.bridge.transfer_plan.Piece` s). One group spans the sending
trainer ranks (group ranks ``0..S-1``) and all workers (``S + worker index``).

Messages go in rounds: round ``k`` carries bucket ``k`` of every (sender, worker) pair as
one batch of point-to-point operations (``batch_isend_irecv``: NCCL may order them as it
likes, so no rank waits on a peer that waits on it). Bucket ``k + 1`` is packed while
round ``k`` is on the wire.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.bridge.schedule import ShardedSchedule
from megarl.bridge.source import ShardSource, TrainerCoords
from megarl.bridge.transfer_plan import Piece
from megarl.bridge.transport import Timer, TransferStats, TransportSender, pack

logger = logging.getLogger(__name__)


def _piece_view(shard: torch.Tensor, piece: Piece) -> torch.Tensor:
    view = shard if piece.dim is None else shard.narrow(piece.dim, piece.src_start, piece.length)
    if view.numel() != piece.numel:
        raise ValueError(
            f"{piece.src}: the shard's piece has {view.numel()} elements, the plan says {piece.numel} "
            f"(shard {tuple(shard.shape)}, dim {piece.dim})"
        )
    return view


class ShardedSender(TransportSender):
    """Trainer side. ``num_senders``: trainer ranks in the group (workers follow them)."""

    mode = "sharded"

    def __init__(
        self,
        schedule: ShardedSchedule,
        coords: TrainerCoords,
        group: dist.ProcessGroup | None,
        num_senders: int,
        dtype: torch.dtype,
    ):
        self.schedule, self.coords, self.group = schedule, coords, group
        self.num_senders, self.dtype = num_senders, dtype
        self.mine = {i for i, owner in enumerate(schedule.senders) if coords.holds(owner)}

    def send(self, source: ShardSource) -> TransferStats:
        stats, packing = TransferStats(), Timer()
        start = time.perf_counter()
        pending: list = []
        for k in range(self.schedule.rounds):
            with packing:
                ops = []
                for s, worker, pieces in self.schedule.round_messages(k):
                    if s in self.mine:
                        buf = pack(
                            (_piece_view(source.local(p.src), p) for p in pieces),
                            sum(p.numel for p in pieces),
                            self.dtype,
                            source.device,
                        )
                        ops.append(dist.P2POp(dist.isend, buf, self.num_senders + worker, group=self.group))
                        stats.bytes_sent += buf.numel() * buf.element_size()
            try:
                works = dist.batch_isend_irecv(ops) if ops else []
                for work in pending:
                    work.wait()  # round k - 1 done while round k was packed
            except RuntimeError as e:  # a worker died or timed out; no trainer collective to keep in step
                stats.error = f"sharded send, round {k}: {e}"
                return stats
            pending = works
            stats.messages += len(ops)
        try:
            for work in pending:
                work.wait()
        except RuntimeError as e:
            stats.error = f"sharded send, last round: {e}"
        stats.seconds, stats.pack_seconds = time.perf_counter() - start, packing.seconds
        return stats


class ShardedReceiver:
    """Worker side: yields ``[(tensor slot, dim, start, length, data)]`` per round, the next round posted.

    ``spec``: the ``receiver_spec`` of sharded mode for this worker. ``data`` is a view of
    a receive buffer shaped like the destination rows, valid until the next round.
    """

    def __init__(self, spec: dict, group: dist.ProcessGroup, dtype: torch.dtype, device):
        if spec["mode"] != "sharded":
            raise ValueError(f"sharded receiver got a {spec['mode']!r} spec")
        self.spec, self.group, self.dtype, self.device = spec, group, dtype, device
        self.shapes = [tuple(t[2]) for t in spec["tensors"]]
        self.stats = TransferStats()

    def _piece_shape(self, slot: int, dim: int | None, length: int) -> tuple[int, ...]:
        shape = list(self.shapes[slot])
        if dim is not None:
            shape[dim] = length
        return tuple(shape)

    def receive(self) -> Iterator[list[tuple[int, int | None, int, int, torch.Tensor]]]:
        start = time.perf_counter()
        pending = None
        for msgs in self.spec["rounds"]:
            posted = []
            for sender, pieces in msgs:
                shapes = [self._piece_shape(slot, dim, length) for slot, dim, _, length in pieces]
                buf = torch.empty(sum(torch.Size(s).numel() for s in shapes), dtype=self.dtype, device=self.device)
                peer = self.spec["sender_ranks"][sender]
                posted.append((buf, pieces, shapes, dist.P2POp(dist.irecv, buf, peer, group=self.group)))
            works = dist.batch_isend_irecv([op for *_, op in posted]) if posted else []
            if pending is not None:
                yield self._finish(*pending)
            pending = (works, posted)
        if pending is not None:
            yield self._finish(*pending)
        self.stats.seconds = time.perf_counter() - start

    def _finish(self, works, posted) -> list:
        for work in works:
            work.wait()
        out = []
        for buf, pieces, shapes, _ in posted:
            offset = 0
            for (slot, dim, dest_start, length), shape in zip(pieces, shapes):
                n = torch.Size(shape).numel()
                out.append((slot, dim, dest_start, length, buf[offset : offset + n].view(shape)))
                offset += n
            self.stats.bytes_received += buf.numel() * buf.element_size()
            self.stats.messages += 1
        return out
