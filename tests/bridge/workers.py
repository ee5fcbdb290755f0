"""Functions the multi-process bridge tests run on each rank (``tests.actor.dist_utils.run_ranks``).

Ranks ``0..T-1`` play the trainer: their shards come from the HF checkpoint through the
family mapping (``load_shard``), scaled by the update number so that every update
carries different bytes. Ranks ``T..`` play inference workers with fake receivers that
rebuild what arrives. Everyone shares one default gloo group only to build the
trainer's TP / ETP groups; the bridge groups are the bridge's own.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megarl.bridge.schedule import broadcast_schedule, receiver_spec, sharded_schedule
from megarl.bridge.source import ShardSource, TrainerCoords
from megarl.bridge.transfer_plan import build_plan
from megarl.bridge.transport import ReceiveBuffers
from megarl.bridge.transport_broadcast import BroadcastReceiver, BroadcastSender
from megarl.bridge.transport_disk import DiskSender, iter_checkpoint
from megarl.bridge.transport_sharded import ShardedReceiver, ShardedSender
from megarl.bridge.wiring import make_wiring, trainer_join, worker_join
from megarl.config.allocation import TrainingAllocation
from megarl.models.build import describe
from megarl.models.hf_io import SafetensorsReader
from megarl.models.mapping import load_shard

WIRE = torch.bfloat16


def layout_coords(layout: TrainingAllocation) -> list[TrainerCoords]:
    """Megatron's rank order: TP fastest, then DP, then PP; experts re-split a stage as ETP, EP, EDP."""
    out = []
    for rank in range(layout.world_size):
        pp, within = divmod(rank, layout.dp * layout.tp)
        dp, tp = divmod(within, layout.tp)
        etp, rest = within % layout.expert_tp, within // layout.expert_tp
        out.append(TrainerCoords(rank, pp, tp, dp, rest % layout.ep, etp, rest // layout.ep))
    return out


def _groups(coords: list[TrainerCoords]) -> tuple[dict, dict]:
    """TP and ETP groups (every process of the default group takes part in creating each)."""
    tp, etp = {}, {}
    for key_fn, out in ((lambda c: ("tp", c.pp, c.dp), tp), (lambda c: ("etp", c.pp, c.ep, c.edp), etp)):
        keys = sorted({key_fn(c) for c in coords})
        for key in keys:
            ranks = [c.rank for c in coords if key_fn(c) == key]
            group = dist.new_group(ranks, backend="gloo")
            for r in ranks:
                out[r] = group
    return tp, etp


def trainer_source(
    model_dir: str, layout: TrainingAllocation, coords: TrainerCoords, tp_group, etp_group, scale: float
) -> ShardSource:
    """This rank's shards of the checkpoint (times ``scale``), as the actor would hold them."""
    desc = describe(model_dir, layout.tp)
    reader = SafetensorsReader(model_dir)
    plan = build_plan(desc, {n: reader.shape(n) for n in reader.keys()}, layout, (1,), sharded=False)  # noqa: SIM118 (the reader is not iterable)
    params = {}
    for src in plan.sources:
        if src.pp != coords.pp or (src.rule.is_expert and src.ep != coords.ep):
            continue
        rank, size = (coords.etp, layout.expert_tp) if src.rule.is_expert else (coords.tp, layout.tp)
        shard = load_shard(src.rule, src.hf_names, reader, reader.shape(src.hf_names[0]), rank, size, desc.dims)
        params[src.megatron] = shard * scale
    tp_group = tp_group if layout.tp > 1 else None
    etp_group = etp_group if layout.expert_tp > 1 else None
    return ShardSource(params, coords, desc.dims, tp_group, etp_group)


def transfer(
    model_dir: str,
    layout: dict,
    server_tp: list[int],
    ports: list[int],
    bucket_numel: int,
    disk_dir: str,
    updates: int = 2,
) -> dict:
    """Run ``updates`` rounds of broadcast, sharded and disk transfers; workers return what they got."""
    dist.init_process_group("gloo")
    layout = TrainingAllocation(**layout)
    rank, num_trainers = dist.get_rank(), layout.world_size
    coords = layout_coords(layout)
    tp_groups, etp_groups = _groups(coords)
    reader = SafetensorsReader(model_dir)
    desc = describe(model_dir, layout.tp)
    plan = build_plan(desc, {n: reader.shape(n) for n in reader.keys()}, layout, tuple(server_tp))  # noqa: SIM118 (the reader is not iterable)
    bsched, ssched = broadcast_schedule(plan, bucket_numel), sharded_schedule(plan, bucket_numel)
    rank_of = {o: next(c.rank for c in coords if c.holds(o)) for o in bsched.senders + ssched.senders}.__getitem__
    port_iter = iter(ports)
    wiring = make_wiring(
        "gloo",
        len(plan.workers),
        bsched.senders,
        ssched.senders,
        rank_of,
        lambda r, k: ("127.0.0.1", next(port_iter)),
        "test",
    )
    trainer_group = dist.new_group(list(range(num_trainers)), backend="gloo")  # collective: every process
    if rank < num_trainers:
        return _trainer(
            model_dir,
            layout,
            plan,
            bsched,
            ssched,
            wiring,
            coords[rank],
            tp_groups.get(rank),
            etp_groups.get(rank),
            trainer_group,
            Path(disk_dir),
            updates,
        )
    return _worker(plan, wiring, rank - num_trainers, bucket_numel, Path(disk_dir), updates)


def _trainer(
    model_dir, layout, plan, bsched, ssched, wiring, coords, tp_group, etp_group, trainer_group, disk_dir, updates
):
    bgroups, sgroup = trainer_join(wiring, coords.rank, timeout=60)
    senders = {
        "broadcast": BroadcastSender(plan, bsched, coords, bgroups, WIRE),
        "sharded": ShardedSender(ssched, coords, sgroup, len(wiring.sharded_members), WIRE),
        "disk": DiskSender(plan, bsched, coords, WIRE, source_dir=model_dir, barrier_group=trainer_group),
    }
    stats = {}
    for update in range(updates):
        source = trainer_source(model_dir, layout, coords, tp_group, etp_group, scale=1.0 + update)
        for mode, sender in senders.items():
            sender.path = disk_dir / f"u{update}"
            stats[mode, update] = sender.send(source).as_dict()
            if mode == "disk":
                dist.barrier()  # tells the workers the files are there
    return {"stats": stats}


def _worker(plan, wiring, worker: int, bucket_numel: int, disk_dir: Path, updates: int) -> dict:
    bgroups, sgroup = worker_join(wiring, worker, timeout=60)
    bspec = receiver_spec(plan, worker, "broadcast", bucket_numel)
    sspec = receiver_spec(plan, worker, "sharded", bucket_numel, wiring.sender_ranks)
    got = {}
    buffers = ReceiveBuffers(keep=True)  # as a CPU worker that stages: update 1 arrives in update 0's buffers
    for update in range(updates):
        receiver = BroadcastReceiver(bspec, bgroups, WIRE, "cpu", buffers)
        got["broadcast", update] = {n: t.clone() for bucket in receiver.receive() for n, t in bucket}
        sharded = ShardedReceiver(sspec, sgroup, WIRE, "cpu", buffers)
        got["sharded", update] = assemble_sharded(sspec, sharded.receive())
        got["sharded_bytes", update] = sharded.stats.bytes_received
        got["buffers", update] = {key: t.data_ptr() for key, t in buffers.kept.items()}
        dist.barrier()
        got["disk", update] = dict(iter_checkpoint(disk_dir / f"u{update}"))
    return {"worker": worker, "got": got}


def assemble_sharded(spec: dict, rounds) -> dict:
    """Local tensors rebuilt from received pieces (padding rows zero), keyed by (name, expert)."""
    tensors = [torch.zeros(shape, dtype=WIRE) for _, _, shape, _ in spec["tensors"]]
    for items in rounds:
        for slot, dim, start, length, data in items:
            target = tensors[slot] if dim is None else tensors[slot].narrow(dim, start, length)
            target.copy_(data)
    return {(name, expert): t for (name, expert, _, _), t in zip(spec["tensors"], tensors)}


def expected_local(plan, worker: int, hf: dict, scale: float) -> dict:
    """Each local tensor of ``worker`` cut from the HF tensors by its segments (the target layout's definition)."""
    out = {}
    for local in plan.local[worker]:
        parts = []
        for seg in local.segments:
            if seg.hf is None:
                shape = list(local.shape)
                shape[local.dim] = seg.length
                parts.append(torch.zeros(shape))
            elif local.dim is None:
                parts.append(hf[seg.hf] * scale)
            else:
                parts.append((hf[seg.hf] * scale).narrow(local.dim, seg.start, seg.length))
        out[local.name, local.expert] = (parts[0] if local.dim is None else torch.cat(parts, local.dim)).to(WIRE)
    return out


# ---------------------------------------------------------------------------------------
# end to end: a Megatron actor updating real vLLM servers
# ---------------------------------------------------------------------------------------


def nll_loss(head, mb: dict) -> torch.Tensor:
    """Mean next-token negative log-likelihood of the micro-batch (an SFT step moves every weight)."""
    mask = mb["label_mask"]
    return -(head.logprobs(mb["labels"]) * mask).sum() / mask.sum().clamp(min=1)


def e2e_sync(
    model_dir: str, alloc: str, servers: list, modes: list[str], disk_dir: str, lr: float = 1e-2, threshold: float = 0.1
) -> list[dict]:
    """Per mode: one optimizer step, the servers' probe mismatch before the update, then ``update_weights``."""
    from megarl.actor.engine import MegatronEngine
    from megarl.bridge.consistency import compare, trainer_probe_scores
    from megarl.config.bridge import WeightUpdateConfig
    from megarl.config.train import OptimizerConfig
    from megarl.run.weight_sync import WeightUpdateMeta, connect_engine
    from megarl.serving import make_control
    from tests.actor.workers import engine_config, make_batch

    optimizer = OptimizerConfig(lr=lr, weight_decay=0.0, gradient_clipping=0.0, use_distributed_optimizer=False)
    engine = MegatronEngine(engine_config(model_dir, dtype="auto", optimizer=optimizer))
    engine.create_process_group(alloc)
    engine.initialize()
    config = WeightUpdateConfig(
        mode=modes[0],
        extra_modes=list(modes[1:]),
        disk_path=disk_dir,
        bucket_mb=1,
        consistency_threshold=threshold,
        probe_sequences=2,
        probe_tokens=24,
        probe_every=1,
        init_timeout=300,
        update_timeout=300,
    )
    meta = WeightUpdateMeta(config)
    controls = [make_control("vllm", address, tp, 300) for address, tp in servers]
    sync = connect_engine(engine, None, meta, servers=controls)
    batch = make_batch([32, 24, 40, 16], seed=1, vocab=engine.desc.dims.vocab_size)
    out = []
    for version, mode in enumerate(modes, start=1):
        engine.train_batch(batch, nll_loss, lambda mb: float(mb["label_mask"].sum()))
        ours = trainer_probe_scores(engine, sync.probe)[0]
        theirs = {s.address: s.score(sync.probe) for s in controls} if dist.get_rank() == 0 else None
        before = sync.bridge.broadcast_object(theirs)
        stats = sync.update_weights(WeightUpdateMeta(config, version=version, mode=mode))
        out.append(
            {
                "mode": mode,
                "before": compare(ours, before, 0).as_dict(),
                "after": stats,
                "version": engine.get_version(),
            }
        )
    return out


def pause_resume_sync(model_dir: str, address: str, tp: int, max_new_tokens: int = 300) -> dict:
    """Generations in flight through a RemoteInferenceEngine while ``update_weights`` pauses, syncs and resumes."""
    import asyncio
    import threading
    import time

    from megarl.actor.engine import MegatronEngine
    from megarl.api.io_struct import GenerationHyperparameters, ModelRequest
    from megarl.config.bridge import WeightUpdateConfig
    from megarl.config.rollout import InferenceEngineConfig
    from megarl.config.train import OptimizerConfig
    from megarl.rollout import RemoteInferenceEngine
    from megarl.run.weight_sync import WeightUpdateMeta, connect_engine
    from megarl.serving import make_control
    from tests.actor.workers import engine_config, make_batch

    optimizer = OptimizerConfig(lr=1e-2, weight_decay=0.0, gradient_clipping=0.0, use_distributed_optimizer=False)
    engine = MegatronEngine(engine_config(model_dir, dtype="auto", optimizer=optimizer))
    engine.create_process_group("megatron:d1p1t1")
    engine.initialize()
    rollout = RemoteInferenceEngine(
        InferenceEngineConfig(request_timeout=120, setup_timeout=60, pause_grace_period=0.05), "vllm"
    )
    rollout.initialize(server_addrs=[address], batch_size=4)
    config = WeightUpdateConfig(mode="sharded", bucket_mb=1, probe_sequences=1, probe_tokens=8)
    meta = WeightUpdateMeta(config)
    sync = connect_engine(engine, rollout, meta, servers=[make_control("vllm", address, tp)])
    batch = make_batch([32, 24], seed=2, vocab=engine.desc.dims.vocab_size)
    engine.train_batch(batch, nll_loss, lambda mb: float(mb["label_mask"].sum()))

    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    requests = [ModelRequest(input_ids=[1, 100 + i, 200 + i], gconfig=gconfig) for i in range(4)]
    responses: list = []

    async def generate_all():
        return await asyncio.gather(*(rollout.agenerate(r) for r in requests))

    started = time.perf_counter()
    asyncio.run(generate_all())  # once without an update: how long the batch takes on this server now
    alone = time.perf_counter() - started
    thread = threading.Thread(target=lambda: responses.extend(asyncio.run(generate_all())))
    thread.start()
    time.sleep(alone / 4)  # generating, far from done (a fixed 2 s outlasted the batch on a fast machine)
    stats = sync.update_weights(meta)
    thread.join(300)
    rollout.destroy()
    return {
        "stats": stats,
        "version": engine.get_version(),
        "rollout_version": rollout.get_version(),
        "responses": [
            {
                "tokens": r.output_tokens,
                "versions": r.output_versions,
                "stop": r.stop_reason,
                "interruptions": r.n_interruptions,
            }
            for r in responses
        ],
    }


def sglang_transfer(model_dir: str, layout: dict, addresses: list[str], dump_dir: str, disk_dir: str) -> dict:
    """A trainer (fake shards) updating fake SGLang servers: two broadcast updates, then one from disk."""
    from megarl.bridge.bridge import WeightBridge
    from megarl.config.bridge import WeightUpdateConfig
    from megarl.serving.control import http_json
    from megarl.serving.sglang import SGLangControl

    dist.init_process_group("gloo")
    layout = TrainingAllocation(**layout)
    coords = layout_coords(layout)[dist.get_rank()]
    tp_groups, etp_groups = _groups(layout_coords(layout))
    reader = SafetensorsReader(model_dir)
    config = WeightUpdateConfig(
        mode="broadcast",
        extra_modes=["disk"],
        disk_path=disk_dir,
        bucket_mb=1,
        dtype="bfloat16",
        init_timeout=120,
        update_timeout=120,
    )
    bridge = WeightBridge(
        config,
        describe(model_dir, layout.tp),
        {n: reader.shape(n) for n in reader.keys()},  # noqa: SIM118 (the reader is not iterable)
        layout,
        coords,
        source_dir=model_dir,
    )
    bridge.connect([SGLangControl(a, 1, timeout=120) for a in addresses])
    reports = []
    for version, mode in ((1, "broadcast"), (2, "broadcast"), (3, "disk")):
        source = trainer_source(
            model_dir, layout, coords, tp_groups.get(coords.rank), etp_groups.get(coords.rank), scale=float(version)
        )
        reports.append(bridge.update(source, version, mode))
        if coords.rank == 0:
            for i, address in enumerate(addresses):
                http_json(address, "/fake/dump", {"path": f"{dump_dir}/v{version}-s{i}.pt"})
    return {"reports": [(r.ok, r.failed, r.sender_errors, r.updated) for r in reports]}


def fault_transfer(model_dir: str, addresses: list[str], mode: str, dump_dir: str) -> list:
    """Three updates to fake vLLM servers, one of which dies during the second; reconnect to the survivor."""
    from megarl.bridge.bridge import WeightBridge
    from megarl.config.bridge import WeightUpdateConfig
    from megarl.serving.control import http_json
    from megarl.serving.vllm import VLLMControl

    layout, coords = TrainingAllocation(), TrainerCoords(0)
    reader = SafetensorsReader(model_dir)
    config = WeightUpdateConfig(mode=mode, bucket_mb=0.25, init_timeout=60, update_timeout=10, dtype="bfloat16")
    bridge = WeightBridge(
        config,
        describe(model_dir, 1),
        {n: reader.shape(n) for n in reader.keys()},
        layout,
        coords,  # noqa: SIM118 (the reader is not iterable)
        source_dir=model_dir,
    )
    controls = [VLLMControl(a, 1, timeout=60) for a in addresses]
    bridge.connect(controls)
    out = []
    for version in (1, 2, 3):
        if not bridge.connected:  # what WeightSync does after a failure: reconnect to the survivors
            bridge.connect([c for c in controls if c.healthy()])
        report = bridge.update(trainer_source(model_dir, layout, coords, None, None, scale=float(version)), version)
        out.append(
            {"ok": report.ok, "failed": report.failed, "sender_errors": report.sender_errors, "updated": report.updated}
        )
        for address in report.updated + [a for a in report.failed if VLLMControl(a, 1).healthy()]:
            http_json(address, "/fake/dump", {"path": f"{dump_dir}/v{version}-{address.replace(':', '_')}.pt"})
    return out
