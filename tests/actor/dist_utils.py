"""Run a function on N local ranks (gloo on 127.0.0.1), torchrun-style, and collect what each returns.

Each rank is a fresh ``python`` subprocess with the torchrun environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and one OpenMP thread; it imports
``target`` ("module:function"), calls it with the pickled keyword arguments and
``torch.save``s the return value. Fresh processes keep Megatron's global state out
of the pytest process and give every test clean groups.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megarl.utils.network import find_free_port

REPO = Path(__file__).resolve().parents[2]
_BOOT = "from tests.actor.dist_utils import _rank_main; _rank_main()"


PORT_ATTEMPTS = 3
"""Rendezvous ports tried: the free port found is released before rank 0 binds it, and another
process (a parallel test's ranks, any outgoing connection) can take it in between."""


def run_ranks(world_size: int, target: str, timeout: float = 300.0, **kwargs) -> list:
    """Run ``target(**kwargs)`` on ``world_size`` ranks; return the per-rank results (rank order).
    Ranks that could not bind their rendezvous port are started again on another."""
    with tempfile.TemporaryDirectory(prefix="megarl_ranks_") as tmp:
        tmp = Path(tmp)
        (tmp / "args.pkl").write_bytes(pickle.dumps(kwargs))
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = find_free_port()
            procs = [_start(rank, world_size, port, target, tmp) for rank in range(world_size)]
            try:
                _wait(procs, timeout, tmp)
                break
            except RuntimeError as exc:
                if attempt == PORT_ATTEMPTS or not _lost_the_port(str(exc), port):
                    raise
        return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _lost_the_port(logs: str, port: int) -> bool:
    """Whether the ranks failed because their rendezvous port was taken before rank 0 bound it."""
    return "EADDRINUSE" in logs and f"port: {port}," in logs


def dp_rows(results: list, key: str, shape: torch.Size) -> torch.Tensor:
    """The whole ``[B, S]`` tensor ``key`` from ranks that each return rows ``dp_rank::dp`` of it
    (with their ``dp_rank``; TP / PP peers return the same rows)."""
    dp = 1 + max(r["dp_rank"] for r in results)
    full = torch.zeros(shape)
    for r in results:
        full[r["dp_rank"] :: dp] = r[key]
    return full


def assert_grads_close(got: dict, want: dict, rtol: float) -> None:
    """The same tensor names, each within ``rtol`` x the largest gradient of ``want``."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    scale = max(t.abs().max().item() for t in want.values())
    for name, tensor in want.items():
        err = (got[name] - tensor).abs().max().item()
        assert err <= rtol * scale, f"{name}: max |diff| {err:.3g} > {rtol} x {scale:.3g}"


def _start(rank: int, world_size: int, port: int, target: str, tmp: Path) -> subprocess.Popen:
    env = dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        MEGARL_TEST_TARGET=target,
        MEGARL_TEST_DIR=str(tmp),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        PYTHONWARNINGS="ignore",
    )
    log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115 (the child writes it until it exits)
    return subprocess.Popen([sys.executable, "-c", _BOOT], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(procs: list[subprocess.Popen], timeout: float, tmp: Path) -> None:
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        logs = "\n".join(f"--- rank {i} ---\n{(tmp / f'rank{i}.log').read_text()[-6000:]}" for i in bad)
        raise RuntimeError(f"ranks {bad} failed (or timed out after {timeout}s):\n{logs}")


def _rank_main() -> None:
    import importlib
    import logging

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    tmp = Path(os.environ["MEGARL_TEST_DIR"])
    module, _, name = os.environ["MEGARL_TEST_TARGET"].partition(":")
    kwargs = pickle.loads((tmp / "args.pkl").read_bytes())
    result = getattr(importlib.import_module(module), name)(**kwargs)
    torch.save(result, tmp / f"rank{os.environ['RANK']}.pt")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
