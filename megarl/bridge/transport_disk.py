"""Disk mode: the owning stages write HF safetensors in parallel; the servers reload from the directory.

Each broadcast sender (a stage's TP rank 0, or an expert shard's ETP rank 0) gathers its
parameters bucket by bucket, as in broadcast mode, and writes every bucket as one
``model-NNNNN-of-MMMMM.safetensors`` file (the write of bucket ``k`` runs in a thread
while bucket ``k + 1`` is gathered). Global rank 0 also writes the index and copies the
non-weight files (config, tokenizer) of the source model, so the directory is a
complete HF checkpoint: SGLang's ``/update_weights_from_disk`` and megarl's vLLM
receiver load it like any other.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.bridge.schedule import BroadcastSchedule
from megarl.bridge.source import ShardSource, TrainerCoords
from megarl.bridge.transfer_plan import TransferPlan
from megarl.bridge.transport import Timer, TransferStats, TransportSender

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"


def shard_files(schedule: BroadcastSchedule) -> list[list[str]]:
    """File name of every (sender, bucket), numbered in schedule order."""
    total = sum(len(b) for b in schedule.buckets)
    names, seq = [], 0
    for buckets in schedule.buckets:
        names.append([f"model-{seq + b + 1:05d}-of-{total:05d}.safetensors" for b in range(len(buckets))])
        seq += len(buckets)
    return names


def write_index(
    plan: TransferPlan, schedule: BroadcastSchedule, out: Path, itemsize: int, source_dir: str | None
) -> None:
    """The HF index of the shard files, and the source model's non-weight files."""
    weight_map = {}
    for i, files in enumerate(shard_files(schedule)):
        for b, file in enumerate(files):
            weight_map.update({name: file for name, _ in schedule.entries(plan, i, b)})
    size = sum(math.prod(plan.hf_shapes[n]) for n in weight_map) * itemsize
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=1))
    if source_dir is not None:
        for path in Path(source_dir).iterdir():
            if path.is_file() and not path.name.endswith(".safetensors") and path.name != INDEX_NAME:
                shutil.copyfile(path, out / path.name)


class DiskSender(TransportSender):
    """Trainer side: every rank calls :meth:`send` with the directory of this update (shared storage)."""

    mode = "disk"

    def __init__(
        self,
        plan: TransferPlan,
        schedule: BroadcastSchedule,
        coords: TrainerCoords,
        dtype: torch.dtype,
        source_dir: str | None = None,
        barrier_group=None,
    ):
        self.plan, self.schedule, self.coords, self.dtype = plan, schedule, coords, dtype
        self.source_dir, self.barrier_group = source_dir, barrier_group
        self.path: Path | None = None

    def send(self, source: ShardSource) -> TransferStats:
        if self.path is None:
            raise ValueError("DiskSender: set .path (the directory of this update) before send()")
        stats, packing = TransferStats(), Timer()
        start = time.perf_counter()
        if self.coords.rank == 0:  # a directory reused across runs must not mix in stale shards
            shutil.rmtree(self.path, ignore_errors=True)
            self.path.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier(group=self.barrier_group)
        files = shard_files(self.schedule)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-disk") as writer:
            pending = []
            for i, owner in enumerate(self.schedule.senders):
                if not self.coords.gathers_for(owner):
                    continue
                is_writer = self.coords.holds(owner)
                for b, bucket in enumerate(self.schedule.buckets[i]):
                    with packing:
                        tensors = {n: t for src in bucket for n, t in source.gather_hf(src).items()}
                    if is_writer:
                        cpu = {n: t.to("cpu", self.dtype).contiguous() for n, t in tensors.items()}
                        stats.bytes_sent += sum(t.numel() * t.element_size() for t in cpu.values())
                        pending.append(writer.submit(_save, cpu, self.path / files[i][b]))
            for future in pending:
                future.result()
        if self.coords.rank == 0:
            write_index(self.plan, self.schedule, self.path, self.dtype.itemsize, self.source_dir)
        if dist.is_initialized():
            dist.barrier(group=self.barrier_group)  # every file written before any server reads
        stats.messages = len(pending)
        stats.seconds, stats.pack_seconds = time.perf_counter() - start, packing.seconds
        return stats


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(path)  # readers never see a half-written file


def iter_checkpoint(path: str | Path):
    """``(HF name, tensor)`` of every tensor of an HF directory, in the index's order when it has one.

    The index lists tensors in model order (as broadcast mode sends them); safetensors
    files store their keys sorted by name, which would interleave layers' parts.
    """
    from safetensors import safe_open

    path = Path(path)
    index = path / INDEX_NAME
    if index.exists():
        order = list(json.loads(index.read_text())["weight_map"].items())
    else:
        order = []
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                order += [(name, file.name) for name in handle.keys()]  # noqa: SIM118 (not iterable)
    handles = {}
    try:
        for name, file in order:
            if file not in handles:
                handles[file] = safe_open(str(path / file), framework="pt")
            yield name, handles[file].get_tensor(name)
    finally:
        handles.clear()
