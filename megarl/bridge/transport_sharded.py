"""Sharded mode: each inference worker receives only its own slices, from the ranks holding them.

No gather: a trainer rank sends, straight from its local Megatron shard, the runs of
rows that overlap each worker's local tensors (fused QKV, gate/up and experts included,
per the plan's :class:`~megarl.bridge.transfer_plan.Piece` s). One group spans the sending
trainer ranks (group ranks ``0..S-1``) and the workers of one block of servers (``S + worker
index``; :class:`~megarl.bridge.blocks.BlockSenders` runs one sender per block).

Messages go in rounds: round ``k`` carries bucket ``k`` of every (sender, worker) pair as
one batch of point-to-point operations (``batch_isend_irecv``: NCCL may order them as it
likes, so no rank waits on a peer that waits on it). Bucket ``k + 1`` is packed while
round ``k`` is on the wire.

A worker that dies mid-transfer (its server killed) costs only its own messages: on gloo every
message is its own operation, so a send to it that fails (connection reset, or the group's
timeout for a peer that stopped reading) marks that worker lost, the sender sends it nothing more
and goes on with the others, who take the whole update. A worker alive but not receiving (its
server hangs before it posts its receives) is lost the same way once a send to it has waited past
the relative deadline (``WeightUpdateConfig.relative_deadline`` of the rounds' waits so far; gloo
closes that worker's connection). The lost worker's server fails its own update call (it died, or
it cannot have received everything); the sender reports no error. On NCCL a round is one coalesced
operation, so a failure there is the whole sender's, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.bridge.schedule import ShardedSchedule
from megarl.bridge.source import ShardSource, TrainerCoords
from megarl.bridge.transfer_plan import Piece
from megarl.bridge.transport import ReceiveBuffers, Timer, TransferStats, TransportSender, pack
from megarl.config.bridge import WeightUpdateConfig

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
    """Trainer side. ``num_senders``: trainer ranks in the group (workers follow them); ``config``: the
    deadlines of a send to a worker that does not receive (None: the group's timeout)."""

    mode = "sharded"

    def __init__(
        self,
        schedule: ShardedSchedule,
        coords: TrainerCoords,
        group: dist.ProcessGroup | None,
        num_senders: int,
        dtype: torch.dtype,
        config: WeightUpdateConfig | None = None,
    ):
        self.schedule, self.coords, self.group = schedule, coords, group
        self.num_senders, self.dtype, self.config = num_senders, dtype, config
        self.mine = {i for i, owner in enumerate(schedule.senders) if coords.holds(owner)}
        self.round_seconds: list[float] = []
        """How long the last rounds' sends took to complete (no worker lost): the deadline's median."""

    def message_limit(self) -> timedelta | None:
        """How long one send may wait for its worker (gloo), relative to the rounds so far."""
        return None if self.config is None else timedelta(seconds=self.config.relative_deadline(self.round_seconds))

    def send(self, source: ShardSource) -> TransferStats:
        stats = TransferStats()
        for _ in self.rounds(source, stats):
            pass
        return stats

    def rounds(self, source: ShardSource, stats: TransferStats) -> Iterator[int]:
        """The send, a round at a time: yields ``k`` once round ``k`` is posted and round ``k - 1`` done,
        so that the senders of several blocks go round by round together
        (:class:`~megarl.bridge.blocks.BlockSenders`); ``stats`` is filled as it goes."""
        packing = Timer()
        start = time.perf_counter()
        lost: dict[int, str] = {}  # worker -> why its messages stopped
        per_message = self.group is not None and dist.get_backend(self.group) == "gloo"
        pending: list = []
        for k in range(self.schedule.rounds):
            with packing:
                messages = []
                for s, worker, pieces in self.schedule.round_messages(k):
                    if s in self.mine and worker not in lost:
                        buf = pack(
                            (_piece_view(source.local(p.src), p) for p in pieces),
                            sum(p.numel for p in pieces),
                            self.dtype,
                            source.device,
                        )
                        messages.append((worker, buf))
            try:
                if per_message:
                    works = self._post_each(messages, lost, k)
                else:
                    ops = [dist.P2POp(dist.isend, b, self.num_senders + w, group=self.group) for w, b in messages]
                    works = [(None, work) for work in (dist.batch_isend_irecv(ops) if ops else [])]
                self._wait(pending, lost, k - 1)  # round k - 1 done while round k was packed
            except RuntimeError as e:  # no trainer collective to keep in step
                stats.error = f"sharded send, round {k}: {e}"
                return
            pending = works
            for worker, buf in messages:
                if worker not in lost:
                    stats.bytes_sent += buf.numel() * buf.element_size()
                    stats.messages += 1
            yield k
        try:
            self._wait(pending, lost, self.schedule.rounds - 1)
        except RuntimeError as e:
            stats.error = f"sharded send, last round: {e}"
        if lost:
            stats.extra["lost_workers"] = lost
        stats.seconds, stats.pack_seconds = time.perf_counter() - start, packing.seconds

    def _post_each(self, messages: list, lost: dict[int, str], k: int) -> list:
        """gloo: each message its own send (what ``batch_isend_irecv`` does there), so that a send to a
        dead worker fails alone: ``[(worker, work)]`` of those posted."""
        works = []
        for worker, buf in messages:
            try:
                works.append((worker, dist.isend(buf, self.num_senders + worker, group=self.group)))
            except RuntimeError as e:
                self._lose(lost, worker, k, e)
        return works

    def _wait(self, works: list, lost: dict[int, str], k: int) -> None:
        """Wait for round ``k``'s sends; a failed one (or, on gloo, one past :meth:`message_limit`) loses
        its worker, or raises where the round was coalesced into one operation (worker None)."""
        start, limit, before = time.perf_counter(), self.message_limit(), len(lost)
        for worker, work in works:
            try:
                work.wait() if worker is None or limit is None else work.wait(limit)
            except RuntimeError as e:
                if worker is None:
                    raise
                self._lose(lost, worker, k, e)
        if works and len(lost) == before:
            self.round_seconds = [*self.round_seconds[-63:], time.perf_counter() - start]

    def _lose(self, lost: dict[int, str], worker: int, k: int, error: Exception) -> None:
        if worker not in lost:
            lost[worker] = f"round {k}: {error}"
            logger.warning(
                "sharded send: inference worker %d lost in round %d (%s); sending it nothing more, the other "
                "workers go on (its server fails its update)",
                worker,
                k,
                str(error).splitlines()[0][:300],
            )


class ShardedReceiver:
    """Worker side: yields ``[(tensor slot, dim, start, length, data)]`` per round, the next round posted.

    ``spec``: the ``receiver_spec`` of sharded mode for this worker. ``data`` is a view of
    a receive buffer shaped like the destination rows, valid until the next round.
    """

    def __init__(
        self, spec: dict, group: dist.ProcessGroup, dtype: torch.dtype, device, buffers: ReceiveBuffers | None = None
    ):
        if spec["mode"] != "sharded":
            raise ValueError(f"sharded receiver got a {spec['mode']!r} spec")
        self.spec, self.group, self.dtype, self.device = spec, group, dtype, device
        self.buffers = buffers or ReceiveBuffers(keep=False)
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
        for k, msgs in enumerate(self.spec["rounds"]):
            posted = []
            for sender, pieces in msgs:
                shapes = [self._piece_shape(slot, dim, length) for slot, dim, _, length in pieces]
                numel = sum(torch.Size(s).numel() for s in shapes)
                buf = self.buffers.get(("sharded", k, sender), numel, self.dtype, self.device)
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
