"""The weight bridge on one device: its group code (NCCL on a GPU) and the trainer-side sender's own rate.

One process, one trainer rank. A Qwen2-shaped checkpoint of random bf16 weights (the 4-layer
Qwen2.5-1.5B shape of ``benchmarks/actor_step.py`` on a GPU; ``--quick`` and on CPU a small one) is
loaded as the rank's Megatron shards on the device, as a trainer holds them (``load_shard``). Then:

* ``group``: a one-member bridge group made by the bridge's own code (``host_store`` and ``join_group``:
  a ``TCPStore``, a ``PrefixStore``, torch's group helper; NCCL on a GPU, gloo on CPU), a broadcast
  and an all-reduce on it with their results checked, and the group destroyed;
* ``send``: the broadcast sender (``BroadcastSender``: per bucket of ``bucket_mb``, each parameter's
  HF tensors made from the shards and packed into one buffer of the wire dtype, then broadcast) over
  that one-member group, where a broadcast leaves the device: the rate of the sender's own work,
  ``GB_per_s`` of the buffers it packs, median of ``repeats`` updates after a warm-up one.

The receiving side (vLLM's or SGLang's workers) is not in it: a GPU run of several processes needs
several GPUs (NCCL refuses two ranks on one).

    python -m benchmarks.bridge_smoke [--quick]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import actor_step
from benchmarks._harness import cpu_kind, main_for

TITLE = "Weight bridge on one device: a bridge group (NCCL on a GPU) and the sender's own rate"
SHAPES = {  # actor_step's shapes (Qwen2-shaped, untied head): its GPU kit one, its quick CPU one
    "qwen2.5-1.5b-4L": actor_step.GPU_SHAPES_QUICK["qwen2.5-1.5b-4L"],
    "small": actor_step.CPU_SHAPES_QUICK["tiny"],
}
BUCKET_MB = {"cuda": 1024, "cpu": 64}  # WeightUpdateConfig.bucket_bytes's defaults
WIRE = torch.bfloat16


def write_checkpoint(out: Path, shape: tuple) -> None:
    """An HF Qwen2 checkpoint of random bf16 weights (names and shapes from the model on the meta device)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    actor_step._write_config(out, shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    names = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(s, generator=gen).to(WIRE) * 0.02 for n, s in names.items()}, out / "model.safetensors")


def _shards(model_dir: Path, device: torch.device):
    """(plan, this one rank's ShardSource on ``device``) for a one-rank trainer and one TP-1 server."""
    from megarl.bridge.source import ShardSource, TrainerCoords
    from megarl.bridge.transfer_plan import build_plan
    from megarl.config.allocation import TrainingAllocation
    from megarl.models.build import describe
    from megarl.models.hf_io import SafetensorsReader
    from megarl.models.mapping import load_shard

    desc, reader = describe(str(model_dir), 1), SafetensorsReader(model_dir)
    shapes = {n: reader.shape(n) for n in reader.keys()}  # noqa: SIM118 (the reader is not iterable)
    plan = build_plan(desc, shapes, TrainingAllocation(), (1,), sharded=False)
    params = {
        src.megatron: load_shard(src.rule, src.hf_names, reader, shapes[src.hf_names[0]], 0, 1, desc.dims).to(device)
        for src in plan.sources
    }
    return plan, ShardSource(params, TrainerCoords(0), desc.dims, None, None)


def group_check(device: torch.device) -> tuple[object, dict]:
    """A one-member bridge group through ``host_store`` / ``join_group``, checked by a broadcast and an
    all-reduce; returns (the group, its row)."""
    import torch.distributed as dist

    from megarl.bridge.groups import default_backend, host_store, join_group

    backend = default_backend(device)
    start = time.perf_counter()
    store = host_store("127.0.0.1", timeout=60)
    group = join_group("127.0.0.1", store.port, 1, 0, "megarl_bridge_smoke", backend, 60, store)
    joined = time.perf_counter() - start
    x = torch.arange(1024, dtype=torch.float32, device=device)
    dist.broadcast(x, src=0, group=group)
    dist.all_reduce(x, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ok = bool(torch.equal(x.cpu(), torch.arange(1024, dtype=torch.float32)))
    return group, {"case": "group", "backend": backend, "join_s": joined, "collectives_ok": ok}


def send_rows(plan, source, group, device: torch.device, repeats: int) -> dict:
    """The broadcast sender over ``group``: ``repeats`` updates after a warm-up one."""
    from megarl.bridge.schedule import broadcast_schedule
    from megarl.bridge.source import TrainerCoords
    from megarl.bridge.transport_broadcast import BroadcastSender

    bucket_mb = BUCKET_MB[device.type]
    schedule = broadcast_schedule(plan, bucket_mb * 2**20 // WIRE.itemsize)
    sender = BroadcastSender(plan, schedule, TrainerCoords(0), {0: group}, WIRE)
    sender.send(source)
    stats = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        stats.append(sender.send(source))
        if device.type == "cuda":
            torch.cuda.synchronize()
    errors = {s.error for s in stats if s.error}
    seconds = [s.seconds for s in stats]
    sent = stats[0].bytes_sent
    return {
        "case": "send",
        "bucket_MB": bucket_mb,
        "buckets": stats[0].messages,
        "GB": sent / 1e9,
        "send_s": statistics.median(seconds),
        "send_s_min": min(seconds),
        "send_s_max": max(seconds),
        "pack_s": statistics.median(s.pack_seconds for s in stats),
        "GB_per_s": sent / 1e9 / statistics.median(seconds),
        "error": "; ".join(sorted(errors)) or None,
    }


def run(quick: bool) -> list[dict]:
    from megarl.bridge.groups import destroy_group

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = "small" if quick or device.type == "cpu" else "qwen2.5-1.5b-4L"
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), SHAPES[name])
        plan, source = _shards(Path(tmp), device)
    group, group_row = group_check(device)
    try:
        send_row = send_rows(plan, source, group, device, repeats=2 if quick else 5)
    finally:
        destroy_group(group)
    return [{"shape": name, "device": str(device), **row} for row in (group_row, send_row)]


def results_name() -> str:
    return "bridge_smoke_gpu" if torch.cuda.is_available() else f"bridge_smoke_{cpu_kind()}"


if __name__ == "__main__":
    main_for(__name__)
