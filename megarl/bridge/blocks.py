"""Blocks: the bridge's servers cut into runs that each have groups of their own.

In sharded mode the sending trainer ranks form one group with the workers of each block of
``weight_update.servers_per_group`` servers instead of one group with every worker. A server
that dies, is evicted, restarts, joins or leaves *releases* its block (:meth:`Block.release`);
the next connect re-forms the released blocks only (:func:`regroup`): their servers, cut again
into blocks of that size, are initialised and join new groups; every other server keeps its
groups and is not called at all. At 256 servers of TP 4 one group holds 1,024 workers and a
single restart re-initialised all of them; with blocks of 16 it re-forms 64.

Each block has its own transfer plan and schedules (one per distinct tuple of its servers' TP
sizes, so blocks alike share them), and sends on its own (:class:`BlockSenders`). In broadcast
mode there is one block (a group per block would send each bucket once per block).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from megarl.bridge.groups import destroy_group
from megarl.bridge.schedule import BroadcastSchedule, ShardedSchedule
from megarl.bridge.transfer_plan import TransferPlan
from megarl.bridge.transport import TransferStats, TransportSender
from megarl.bridge.transport_sharded import ShardedSender
from megarl.bridge.wiring import Wiring


@dataclass(eq=False)
class Block:
    """A run of servers, its plan and schedules, and this trainer rank's groups with them."""

    servers: list
    """Their :class:`~megarl.serving.ServerControl` s on rank 0, :class:`~megarl.serving.ServerRef` s on the
    other ranks; a server's index here is its index in ``plan``."""
    plan: TransferPlan
    broadcast_schedule: BroadcastSchedule
    sharded_schedule: ShardedSchedule | None
    wiring: Wiring | None = None
    broadcast_groups: dict = field(default_factory=dict)
    """Broadcast sender index -> group, for the senders this rank is."""
    sharded_group: object = None
    intact: bool = True
    """False once a server of it is released: its groups re-form at the next connect."""

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def release(self, addresses: set[str]) -> None:
        """Mark the block for re-forming if it holds one of ``addresses``."""
        if addresses.intersection(self.addresses):
            self.intact = False

    def worker_name(self, worker: int) -> str:
        """``address rank r`` of the block's worker ``worker``."""
        server, rank = self.plan.workers[worker]
        return f"{self.servers[server].address} rank {rank}"

    def close(self) -> None:
        for group in [*self.broadcast_groups.values(), self.sharded_group]:
            destroy_group(group)
        self.broadcast_groups, self.sharded_group = {}, None


def regroup(blocks: list[Block], servers: list, size: int) -> tuple[list[Block], list[list]]:
    """``(kept, runs)``: the blocks whose groups stay (intact, every server still wanted, at most ``size``
    servers) and the runs of ``servers`` whose groups form now: the others, in ``servers``' order, cut
    into runs of ``size``; a short last run takes in the smallest kept block it fits with, so that
    servers joining one at a time do not each make a group. The same on every rank (it depends only
    on what every rank was told)."""
    if size < 1:
        raise ValueError(f"a bridge block holds at least one server, not {size}")
    by_address = {s.address: s for s in servers}
    kept = [b for b in blocks if b.intact and len(b.servers) <= size and all(a in by_address for a in b.addresses)]
    placed = {a for b in kept for a in b.addresses}
    rest = [s for s in servers if s.address not in placed]
    runs = [rest[i : i + size] for i in range(0, len(rest), size)]
    if runs and len(runs[-1]) < size:
        fits = [b for b in kept if len(b.servers) + len(runs[-1]) <= size]
        if fits:
            merged = min(fits, key=lambda b: len(b.servers))
            kept.remove(merged)
            runs[-1] = [by_address[a] for a in merged.addresses] + runs[-1]
    return kept, runs


class BlockSenders(TransportSender):
    """Sharded mode over blocks: every block's :class:`ShardedSender` round by round together (round
    ``k`` of each block posted before any block waits on its round ``k``, as with one group), their
    stats summed; a lost worker is named ``address rank r``."""

    mode = "sharded"

    def __init__(self, senders: list[tuple[Block, ShardedSender]]):
        self.senders = senders

    def send(self, source) -> TransferStats:
        start = time.perf_counter()
        each = [TransferStats() for _ in self.senders]
        running = [sender.rounds(source, stats) for (_, sender), stats in zip(self.senders, each)]
        while running:  # a block that fails stops; the others' servers go on receiving
            running = [r for r in running if next(r, None) is not None]
        total, lost, errors = TransferStats(seconds=time.perf_counter() - start), {}, []
        for i, ((block, _), stats) in enumerate(zip(self.senders, each)):
            total.bytes_sent += stats.bytes_sent
            total.messages += stats.messages
            total.pack_seconds += stats.pack_seconds
            if stats.error:
                errors.append(f"block {i} ({', '.join(block.addresses)}): {stats.error}")
            lost.update({block.worker_name(w): why for w, why in stats.extra.get("lost_workers", {}).items()})
        total.error = "; ".join(errors)
        if lost:
            total.extra["lost_workers"] = lost
        return total
