"""Broadcast mode: full HF tensors from each owning stage to every inference worker.

As AReaL, slime and verl do: per sender (a pipeline stage's TP rank 0 of data-parallel
replica 0, or an expert shard's ETP rank 0), its TP / ETP group gathers each parameter
and converts it to HF tensors; the sender packs a bucket and broadcasts it over its own
group ``{sender} + all workers`` (sender = group rank 0). The gather of bucket ``k + 1``
runs while bucket ``k`` is on the wire. Workers slice what they need themselves (vLLM:
``model.load_weights``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.bridge.schedule import BroadcastSchedule
from megarl.bridge.source import ShardSource, TrainerCoords
from megarl.bridge.transfer_plan import TransferPlan
from megarl.bridge.transport import ReceiveBuffers, Timer, TransferStats, TransportSender, pack, unpack

logger = logging.getLogger(__name__)


class BroadcastSender(TransportSender):
    """Trainer side. ``groups``: ``{sender index: group}`` for the senders this rank is.

    ``as_bytes``: broadcast each bucket as uint8 (SGLang's ``flattened_bucket`` receive buffer).
    A failed broadcast is recorded in the stats (``error``) and the rank keeps taking part
    in its TP group's gathers, so no peer hangs; the bridge reports it.
    """

    mode = "broadcast"

    def __init__(
        self,
        plan: TransferPlan,
        schedule: BroadcastSchedule,
        coords: TrainerCoords,
        groups: dict[int, dist.ProcessGroup],
        dtype: torch.dtype,
        as_bytes: bool = False,
    ):
        self.plan, self.schedule, self.coords = plan, schedule, coords
        self.groups, self.dtype, self.as_bytes = groups, dtype, as_bytes

    def send(self, source: ShardSource) -> TransferStats:
        stats, packing = TransferStats(), Timer()
        start = time.perf_counter()
        for i, owner in enumerate(self.schedule.senders):
            if self.coords.gathers_for(owner):
                self._send_one(i, self.coords.holds(owner), source, stats, packing)
        stats.seconds, stats.pack_seconds = time.perf_counter() - start, packing.seconds
        return stats

    def _send_one(self, i: int, is_sender: bool, source: ShardSource, stats: TransferStats, packing: Timer) -> None:
        pending = None
        for b, bucket in enumerate(self.schedule.buckets[i]):
            with packing:
                tensors = [t for src in bucket for t in source.gather_hf(src).values()]  # collective over TP
                if not is_sender or stats.error:
                    continue
                numel = sum(math.prod(shape) for _, shape in self.schedule.entries(self.plan, i, b))
                buf = pack(tensors, numel, self.dtype, source.device)
            try:
                work = dist.broadcast(
                    buf.view(torch.uint8) if self.as_bytes else buf, src=0, group=self.groups[i], async_op=True
                )
                if pending is not None:
                    pending.wait()  # bucket k done while k + 1 was gathered
            except RuntimeError as e:  # a worker died or timed out: stop sending, keep gathering
                stats.error, pending = f"broadcast from sender {i} (bucket {b}): {e}", None
                continue
            pending = work
            stats.bytes_sent += buf.numel() * buf.element_size()
            stats.messages += 1
        if pending is not None:
            try:
                pending.wait()
            except RuntimeError as e:
                stats.error = f"broadcast from sender {i}: {e}"


class BroadcastReceiver:
    """Worker side: yields ``[(HF name, tensor)]`` per bucket, the next bucket already posted.

    ``spec``: the ``receiver_spec`` of broadcast mode; ``groups``: one group per sender,
    in sender order, this worker at rank ``1 + worker index``. The yielded tensors are
    views of a receive buffer, valid until the next bucket is requested.
    """

    def __init__(
        self,
        spec: dict,
        groups: list[dist.ProcessGroup],
        dtype: torch.dtype,
        device,
        buffers: ReceiveBuffers | None = None,
    ):
        if spec["mode"] != "broadcast" or len(groups) != spec["senders"]:
            raise ValueError(f"broadcast receiver: spec for {spec['senders']} senders, {len(groups)} groups given")
        self.spec, self.groups, self.dtype, self.device = spec, groups, dtype, device
        self.buffers = buffers or ReceiveBuffers(keep=False)
        self.stats = TransferStats()

    def receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        start = time.perf_counter()
        for i, (group, buckets) in enumerate(zip(self.groups, self.spec["buckets"])):
            pending = None
            for b, entries in enumerate(buckets):
                shapes = [tuple(shape) for _, shape in entries]
                numel = sum(math.prod(s) for s in shapes)
                buf = self.buffers.get(("broadcast", i, b), numel, self.dtype, self.device)
                work = dist.broadcast(buf, src=0, group=group, async_op=True)
                if pending is not None:
                    yield self._finish(*pending)
                pending = (work, buf, entries, shapes)
            if pending is not None:
                yield self._finish(*pending)
        self.stats.seconds = time.perf_counter() - start

    def _finish(self, work, buf, entries, shapes) -> list[tuple[str, torch.Tensor]]:
        work.wait()
        self.stats.bytes_received += buf.numel() * buf.element_size()
        self.stats.messages += 1
        return [(name, t) for (name, _), t in zip(entries, unpack(buf, shapes))]
