"""What a checkpoint loadable at any layout costs: the distributed optimizer's state written per
parameter (``optimizer.checkpoint_layout: any``, Megatron's ``fully_reshardable``) against per-rank
shards (``data_parallel``, ``dp_reshardable``).

Two gloo ranks on CPU hold SmolLM2-135M's shape (random weights, fp32, Adam, the distributed optimizer
over DP 2) after one training step; each format is saved ``REPEATS`` times and loaded back at the same
layout, and the ``any`` checkpoint at pipeline-parallel 2 too. Per row: seconds to save and to load
(median of the repeats, rank 0), the checkpoint's size, and how much each rank's peak resident memory
grew while saving (the gather holds the model-parallel shard's whole fp32 state on data-parallel rank
0); each format in processes of its own. ``--quick``: one repeat.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

from benchmarks._harness import main_for

TITLE = "Checkpoint formats of the distributed optimizer: save / load time, size, memory (SmolLM2-135M shape, CPU)"
REPEATS, QUICK_REPEATS = 3, 1
MODEL = "smollm2"
FORMATS = ("any", "data_parallel")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _engine(model_dir: str, alloc: str, layout: str):
    from megarl.actor.engine import MegatronEngine
    from megarl.config.train import MicroBatchSpec, OptimizerConfig, TrainEngineConfig

    optimizer = OptimizerConfig(lr=1e-5, use_distributed_optimizer=True, checkpoint_layout=layout)
    cfg = TrainEngineConfig(
        path=model_dir, dtype="float32", init_from_scratch=True, mb_spec=MicroBatchSpec(4096), optimizer=optimizer
    )
    engine = MegatronEngine(cfg)
    engine.create_process_group(alloc)
    engine.initialize()
    return engine


def _one_step(engine) -> None:
    """One Adam step on random tokens (the token-mean NLL), so that the moments are not zero."""
    import torch

    from benchmarks.actor_step import _nll

    gen = torch.Generator().manual_seed(engine.parallel.dp_rank)
    ids = torch.randint(0, 49152, (2, 64), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)}
    engine.train_batch(batch, _nll, lambda mb: mb["label_mask"].sum())


def _rank(rank: int, layout: str, port: int, model_dir: str, out_dir: str, repeats: int, results: dict) -> None:
    """One of two ranks: ``repeats`` saves in ``layout``'s format, then loads (rank 0 records the row)."""
    import torch.distributed as dist

    from megarl.actor.checkpoint import SaveLoadMeta

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    engine = _engine(model_dir, "d2p1t1", layout)
    _one_step(engine)
    path = Path(out_dir) / layout
    saves, grew = [], 0.0
    for _ in range(repeats):
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        before = _peak_rss_mb()
        start = time.perf_counter()
        engine.save(SaveLoadMeta(str(path)))
        dist.barrier()
        saves.append(time.perf_counter() - start)
        grew = max(grew, _peak_rss_mb() - before)
    loads = {}
    for alloc in ("d2p1t1", "d1p2t1") if layout == "any" else ("d2p1t1",):
        engine.destroy()
        engine = _engine(model_dir, alloc, layout)
        start = time.perf_counter()
        engine.load(SaveLoadMeta(str(path)))
        dist.barrier()
        loads[alloc] = time.perf_counter() - start
    grown = [None, None]
    dist.all_gather_object(grown, grew)
    if rank == 0:
        results[layout] = {
            "checkpoint_layout": layout,
            "save s (median)": statistics.median(saves),
            "load s, same layout": loads["d2p1t1"],
            "load s, at d1p2t1": loads.get("d1p2t1"),
            "size MB": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20,
            "peak RSS growth MB, rank 0": grown[0],
            "peak RSS growth MB, rank 1": grown[1],
        }
    engine.destroy()
    dist.destroy_process_group()


def run(quick: bool) -> list[dict]:
    from megarl.models.provision import resolve_model_path
    from megarl.utils.network import find_free_port

    model_dir = resolve_model_path(MODEL)
    with tempfile.TemporaryDirectory(prefix="megarl_ckpt_bench_") as out_dir, mp.Manager() as manager:
        results = manager.dict()
        for layout in FORMATS:
            args = (layout, find_free_port(), str(model_dir), out_dir, QUICK_REPEATS if quick else REPEATS, results)
            mp.start_processes(_rank, args=args, nprocs=2, start_method="spawn")
        return [results[layout] for layout in FORMATS]


def summary(rows: list[dict]) -> str:
    by = {row["checkpoint_layout"]: row for row in rows}
    any_, dp = by["any"], by["data_parallel"]
    return (
        f"any: save {any_['save s (median)']:.1f} s vs {dp['save s (median)']:.1f} s per-rank shards, "
        f"load {any_['load s, same layout']:.1f} vs {dp['load s, same layout']:.1f} s, "
        f"at another layout {any_['load s, at d1p2t1']:.1f} s; peak RSS growth on ranks 0 / 1 "
        f"{any_['peak RSS growth MB, rank 0']:.0f} / {any_['peak RSS growth MB, rank 1']:.0f} vs "
        f"{dp['peak RSS growth MB, rank 0']:.0f} / {dp['peak RSS growth MB, rank 1']:.0f} MB"
    )


if __name__ == "__main__":
    main_for(__name__)
