"""The trainer's CPU threads, phase by phase (``cluster.cpu_threads``).

On a CPU machine the launcher binds each inference server to its cores and gives the
trainer ranks the rest (``OMP_NUM_THREADS``). That static split leaves the servers' cores
idle whenever they have no work: during the weight sync (paused), and during a PPO update
that starts once every episode the staleness bound allows is done. The elastic policy
lends the trainer every core in those phases and gives them back when the phase ends.

Only the thread that computes gets those threads (:func:`set_compute_threads`): every other thread of
the trainer runs its torch work on one, so that the process holds a single OpenMP team.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _thread_local_setters() -> tuple[Callable[[int], None], ...] | None:
    """``omp_set_num_threads`` of the libgomp torch runs on, and MKL's thread-local count; None elsewhere."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    lib = Path(torch.__file__).parent / "lib"
    try:
        gomp = ctypes.CDLL(str(lib / "libgomp.so.1"))  # the copy torch loaded: its RPATH names this one
        setters = [gomp.omp_set_num_threads]
        if torch.backends.mkl.is_available():
            setters.append(ctypes.CDLL(str(lib / "libtorch_cpu.so")).MKL_Set_Num_Threads_Local)
    except (OSError, AttributeError):  # another OpenMP runtime (macOS's libomp), MKL not exported
        return None
    return tuple(setters)


def set_compute_threads(n: int) -> None:
    """Torch's intra-op work of the calling thread on ``n`` threads, that of every other thread on one.

    ``torch.set_num_threads(n)`` sets the count every thread takes when it first runs torch work. A
    gloo thread that then copies a gradient bucket, or the rollout loop building a batch, starts an
    OpenMP team of its own; libgomp, once it manages more threads than the process has cores, stops
    spinning between parallel regions (100 spins instead of ~300,000), so every small operator of a
    step waits for its workers to wake: +10% on the arithmetic job's train phase on a 2-core CPU,
    3x on a loop of small additions. Here the process-wide count is 1 and only the caller's own
    OpenMP and MKL counts are ``n`` (plain ``torch.set_num_threads(n)`` where torch is not built
    with libgomp). Call it before the process starts other threads that run torch work: a thread
    keeps the count it took at its first operator.
    """
    setters = _thread_local_setters()
    torch.get_num_threads()  # the caller's own first-use set-up, which would otherwise undo what follows
    torch.set_num_threads(1 if setters else n)
    for setter in setters or ():
        setter(n)
    if torch.get_num_threads() != n:  # the libgomp found is not the one torch computes with
        logger.warning("set_compute_threads: could not set this thread's OpenMP count; torch.set_num_threads(%d)", n)
        torch.set_num_threads(n)


class TrainerThreads:
    """Switches ``torch``'s intra-op threads between the trainer's share and the machine's.

    Args:
        policy: ``elastic``, ``shared`` or ``static`` (``cluster.cpu_threads``).
        share: Threads while servers generate (``OMP_NUM_THREADS`` of the launcher).
        machine: Threads when the servers idle: this rank's share of every core.
        servers_idle: Whether the servers have no work now (this rank's view; None: never known).
    """

    def __init__(self, policy: str, share: int, machine: int, servers_idle: Callable[[], bool] | None = None):
        self.policy, self.share, self.machine = policy, share, max(share, machine)
        self.servers_idle = servers_idle

    @classmethod
    def for_this_rank(cls, policy: str, on_cpu: bool, servers_idle: Callable[[], bool] | None) -> TrainerThreads:
        """This rank's threads: its share now, and its share of every core of the machine."""
        share = torch.get_num_threads()
        if not on_cpu:
            return cls("static", share, share)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        machine = max(1, len(os.sched_getaffinity(0)) // local_ranks)
        return cls(policy, share, machine, servers_idle)

    def describe(self) -> str:
        if self.policy == "static" or self.machine == self.share:
            return f"{self.share} threads"
        return f"{self.share} threads, {self.machine} while the servers idle (cluster.cpu_threads={self.policy})"

    @contextlib.contextmanager
    def phase(self, servers_paused: bool = False) -> Iterator[None]:
        """Run a trainer phase on every core if the servers are paused or idle at its start."""
        idle = servers_paused or (self.servers_idle is not None and self.servers_idle())
        boost = self.policy != "static" and self.machine > self.share and idle
        if not boost:
            yield
            return
        set_compute_threads(self.machine)
        try:
            yield
        finally:
            set_compute_threads(self.share)
