"""The inference-worker side, independent of the server: join the groups, receive, stage, commit.

A server's receiver (vLLM engine, test fakes) owns one :class:`WorkerReceiver`. An update
is two-phase, so a failure never leaves a server half-updated:

1. :meth:`WorkerReceiver.receive` takes in everything of one update (``stage=True``:
   into staging memory, 1 / TP of the model per worker in sharded mode) and returns it;
   a transport error raises and nothing has been applied;
2. the server applies it when the trainer commits (``finish_weight_update``).

With ``stage=False`` buckets are handed over as they arrive (less memory); a failure
midway then leaves the server half-updated, and the trainer marks it unhealthy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from megarl.bridge.groups import destroy_group
from megarl.bridge.transport import ReceiveBuffers, wire_dtype
from megarl.bridge.transport_broadcast import BroadcastReceiver
from megarl.bridge.transport_disk import iter_checkpoint
from megarl.bridge.transport_sharded import ShardedReceiver
from megarl.bridge.wiring import Wiring, worker_join
from megarl.serving.init_specs import worker_specs

logger = logging.getLogger(__name__)


@dataclass
class ReceiverInit:
    """What a server's workers are told once (JSON): the groups and their receive schedules."""

    wiring: dict
    """:meth:`~megarl.bridge.wiring.Wiring.to_json`."""
    worker_offset: int
    """Worker index of this server's TP rank 0."""
    specs: dict
    """``{str(tp rank): {mode: spec}}`` for this server's workers: a packed spec names its part in
    ``shared`` (:mod:`megarl.bridge.schedule`), a plain one is the ``receiver_spec`` itself."""
    dtype: str = "bfloat16"
    """Wire dtype."""
    timeout: float = 600.0
    """Seconds any join or receive may take."""
    stage: bool = True
    """Receive a whole update before applying any of it (see the module docstring)."""
    shared: dict = field(default_factory=dict)
    """Packed spec parts the specs name, each once per server (base64 of zlib-compressed JSON)."""

    def worker_specs(self, tp_rank: int) -> dict:
        """``{mode: receiver_spec}`` of this server's TP rank ``tp_rank``, unpacked."""
        return worker_specs(self.specs, self.shared, tp_rank)


@dataclass
class Received:
    """One update's data: HF ``(name, tensor)`` pairs (broadcast, disk) or sharded pieces."""

    mode: str
    named: list[tuple[str, torch.Tensor]] | None = None
    pieces: list[tuple[int, int | None, int, int, torch.Tensor]] | None = None
    bytes: int = 0


class WorkerReceiver:
    """One inference worker's end of the bridge."""

    def __init__(self, init: ReceiverInit, tp_rank: int, device):
        self.init, self.tp_rank, self.device = init, tp_rank, torch.device(device)
        self.wiring = Wiring.from_json(init.wiring)
        self.worker = init.worker_offset + tp_rank
        self.specs = init.worker_specs(tp_rank)
        self.dtype = wire_dtype(init.dtype)
        self.broadcast_groups: list = []
        self.sharded_group = None
        self.buffers = ReceiveBuffers(keep=self.device.type == "cpu" and init.stage)
        """Kept between updates on a CPU worker that stages (:class:`~megarl.bridge.transport.ReceiveBuffers`)."""

    def connect(self) -> None:
        """Join every bridge group (blocks until the trainer ranks join too)."""
        self.broadcast_groups, self.sharded_group = worker_join(self.wiring, self.worker, self.init.timeout)

    def close(self) -> None:
        for group in [*self.broadcast_groups, self.sharded_group]:
            destroy_group(group)
        self.broadcast_groups, self.sharded_group = [], None

    def tensor_specs(self) -> list:
        """Sharded mode: ``[name, expert, shape, padding rows]`` of each local tensor (slot order)."""
        return self.specs["sharded"]["tensors"] if "sharded" in self.specs else []

    def stream(self, mode: str, path: str | None = None) -> Iterator[Received]:
        """What arrives, bucket by bucket (views valid until the next bucket)."""
        if mode == "disk":
            if not path:
                raise ValueError("a disk update needs 'path' (the HF directory the trainer wrote)")
            yield Received(mode, named=list(iter_checkpoint(path)))
            return
        if mode not in self.specs:
            raise ValueError(f"this worker was not wired for {mode!r} updates (wired: {sorted(self.specs)})")
        if mode == "broadcast":
            receiver = BroadcastReceiver(self.specs[mode], self.broadcast_groups, self.dtype, self.device, self.buffers)
            for bucket in receiver.receive():
                yield Received(mode, named=bucket, bytes=sum(t.numel() * t.element_size() for _, t in bucket))
            return
        receiver = ShardedReceiver(self.specs[mode], self.sharded_group, self.dtype, self.device, self.buffers)
        for items in receiver.receive():
            yield Received(mode, pieces=items, bytes=sum(d.numel() * d.element_size() for *_, d in items))

    def receive(self, mode: str, path: str | None, apply: Callable[[Received], None]) -> int:
        """Receive one update; ``apply`` gets it whole (``stage``) or per bucket. Returns bytes received."""
        total = 0
        staged: list[Received] = []
        try:
            for part in self.stream(mode, path):
                total += part.bytes
                if self.init.stage and mode != "disk":
                    staged.append(part)  # every bucket has its own receive buffer: keeping the views keeps the bytes
                else:
                    apply(part)
        except BaseException:
            self.buffers.drop()
            raise
        if staged:
            apply(_merge(mode, staged))
        logger.info("worker %d received a %s update (%d bytes)", self.worker, mode, total)
        return total


def _merge(mode: str, parts: list[Received]) -> Received:
    if mode == "broadcast":
        return Received(mode, named=[x for p in parts for x in p.named], bytes=sum(p.bytes for p in parts))
    return Received(mode, pieces=[x for p in parts for x in p.pieces], bytes=sum(p.bytes for p in parts))


def write_pieces(targets: list[torch.Tensor], pieces, experts: list[int | None]) -> None:
    """Copy sharded pieces into ``targets`` (one per tensor slot; ``experts[slot]`` indexes a fused-expert tensor)."""
    for slot, dim, start, length, data in pieces:
        target = targets[slot]
        if experts[slot] is not None:
            target = target[experts[slot]]
        if dim is not None:
            target = target.narrow(dim, start, length)
        target.copy_(data)


def zero_padding(targets: list[torch.Tensor], specs: list) -> None:
    """Zero the padding rows (vocabulary padding) of freshly built tensors."""
    for target, (_, expert, _, padding) in zip(targets, specs):
        view = target if expert is None else target[expert]
        for start, stop in padding:
            view.narrow(0, start, stop - start).zero_()
