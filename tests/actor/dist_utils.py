"""Run a function on N local ranks (gloo on 127.0.0.1), torchrun-style, and collect what each returns.

Each rank is a fresh process with the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) and one OpenMP thread; it imports ``target`` ("module:function"),
calls it with the pickled keyword arguments and ``torch.save``s the return value. Fresh
processes keep Megatron's global state out of the pytest process and give every test clean
groups.

The ranks are forked from one server process per pytest process (multiprocessing's
forkserver) that has imported torch, Megatron-Core and megarl's engine once (:data:`PRELOAD`):
those imports take about ten seconds of CPU, which every rank of every test would repeat.
The server forks before any rank's work, so a rank starts from a process that has only
imported modules: no process group, no Megatron state, no torch thread pool.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import torch

from megarl.utils.network import find_free_port

REPO = Path(__file__).resolve().parents[2]

PRELOAD = [
    "torch.distributed",
    "megatron.core",
    "megarl.actor.engine",
    "megarl.models.hf_io",
    "transformers.models.auto",
    "safetensors.torch",
]
"""Modules the rank server imports before it forks the ranks (a rank imports the rest itself)."""


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


def run_layout(alloc: str, target: str, **kwargs) -> list:
    """:func:`run_ranks` on every rank of the trainer layout ``alloc`` (``d1p2t1``), which ``target`` is also given."""
    from megarl.config.allocation import AllocationMode

    world = AllocationMode.from_str(f"megatron:{alloc}").train.world_size
    return run_ranks(world, target, alloc=alloc, **kwargs)


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


def _start(rank: int, world_size: int, port: int, target: str, tmp: Path) -> multiprocessing.Process:
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
    proc = _rank_server().Process(target=_forked_rank, args=(env, str(tmp / f"rank{rank}.log")), name=f"rank{rank}")
    proc.start()
    return proc


def _rank_server() -> multiprocessing.context.BaseContext:
    """The forkserver context whose server has imported :data:`PRELOAD` (started on first use, with
    the ranks' one OpenMP thread, which the OpenMP runtime reads when torch loads it, and their
    warning filters, which the ranks inherit)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with mock.patch.dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"):
        multiprocessing.forkserver.ensure_running()
    return context


def _forked_rank(env: dict, log: str) -> None:
    """A rank, just forked: ``env`` as its whole environment, ``log`` as its stdout and stderr, the
    repository as its working directory; then :func:`_rank_main` and what the interpreter runs on a
    normal exit, which multiprocessing's children skip: the threads' exit hooks and the wait for
    non-daemon threads (a process pool left open, e.g. the reward executor's, shuts down there),
    then the ``atexit`` handlers."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        _rank_main()
    finally:
        sys.stdout.flush()
        threading._shutdown()
        atexit._run_exitfuncs()


def _wait(procs: list[multiprocessing.Process], timeout: float, tmp: Path) -> None:
    deadline = time.monotonic() + timeout
    try:
        while any(p.exitcode is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
    bad = [i for i, p in enumerate(procs) if p.exitcode != 0]
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
