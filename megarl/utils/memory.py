"""Peak resident memory of this process, phase by phase (``memory/<phase>_peak_gb`` in the step stats),
and a CPU trainer's heap kept from one phase to the next (:func:`keep_freed_memory`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import resource
import threading
from collections.abc import Iterator

from megarl.utils import stats_tracker

_PAGE = os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
"""glibc ``mallopt`` parameters (``malloc.h``)."""

_kept = False
"""Whether :func:`keep_freed_memory` took in this process (``mallopt`` is process-wide)."""


def keep_freed_memory() -> bool:
    """Make this process's heap keep what it frees for the next allocation (glibc; returns whether it took).

    By default glibc serves every allocation above 32 MiB with a fresh ``mmap`` and returns it at once,
    and hands a heap's free top back above a threshold: each train phase of a CPU trainer then touches
    its activations as new pages, every one a page fault the kernel zero-fills (about 600,000 per bf16
    phase of the arithmetic job on a 2-core EPYC, ``docs/development.md``). With
    ``mmap`` off for allocations (``M_MMAP_MAX`` 0) and no trimming (``M_TRIM_THRESHOLD`` at its
    maximum) the next phase reuses the same pages, as CUDA's caching allocator reuses device memory;
    the price is that the process stays at the size of its largest phase.
    """
    global _kept
    libc = _libc()
    if libc is None:
        return False
    _kept = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    return _kept


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``), e.g. before another process
    needs this machine's memory; not between a trainer's phases (:func:`keep_freed_memory`)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class HeapBound:
    """Keeps a kept heap (:func:`keep_freed_memory`) within ``growth`` times its settled size.

    Batches of new sizes leave a kept heap in pieces it cannot reuse, so a long CPU run grows (the
    arithmetic job in bf16: about 28 MB a step, ``docs/guides/memory.md``). The process's resident size
    at the end of step ``settle_steps`` is its settled size; at the end of a later step above
    ``growth`` times it, :func:`release_freed_memory` hands the free part back, and the next phases pay
    their page faults once more. ``settle_steps`` steps after a trim the resident size settles again,
    and the larger of the two sizes is kept: a run whose batches grew for good (a working set past the
    bound) trims once for it, not every step. ``growth`` None never trims; in a process whose heap is
    not kept (not glibc, or a GPU trainer) :meth:`end_step` does nothing.
    """

    def __init__(self, growth: float | None, settle_steps: int = 2):
        self.growth = growth
        self.settle_steps = settle_steps
        self.steps_since_trim = 0
        """Steps since the first one or the last trim."""
        self.settled_bytes = 0
        self.trims = 0

    def end_step(self) -> None:
        """Count a step; trim if over the bound. Records ``memory/heap_trims`` (the run's, so far)."""
        if not _kept or self.growth is None:
            return
        self.steps_since_trim += 1
        if self.steps_since_trim == self.settle_steps:
            self.settled_bytes = max(self.settled_bytes, rss_bytes())
        elif self.steps_since_trim > self.settle_steps and rss_bytes() > self.growth * self.settled_bytes:
            release_freed_memory()
            self.trims += 1
            self.steps_since_trim = 0
        stats_tracker.scalar(**{"memory/heap_trims": float(self.trims)})


def minor_page_faults() -> int:
    """Minor page faults of this process so far (all its threads): pages it touched for the first time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rss_bytes() -> int:
    """Resident set size of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Samples this process's RSS every ``interval`` seconds while a phase runs; records each phase's peak.

    A sampling thread, not ``ru_maxrss``: that is the peak of the whole process life, so it cannot
    tell which phase set it.
    """

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self._peak = 0
        self._lock = threading.Lock()
        self._active = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while True:
            self._active.wait()
            rss = rss_bytes()
            with self._lock:
                self._peak = max(self._peak, rss)
            threading.Event().wait(self.interval)

    def peak_so_far(self) -> int:
        """The highest RSS (bytes) sampled in the phase in progress (or the last one) so far."""
        with self._lock:
            return self._peak

    @contextlib.contextmanager
    def peak(self, name: str) -> Iterator[None]:
        """Record the peak RSS of the block as ``memory/<scopes>/<name>_peak_gb``, and the page faults
        it took to get there (minor ones, the process's: fresh memory touched) as ``..._page_faults``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._sample, name="megarl-rss", daemon=True)
            self._thread.start()
        with self._lock:
            self._peak = rss_bytes()
        faults = minor_page_faults()
        self._active.set()
        try:
            yield
        finally:
            self._active.clear()
            with self._lock:
                peak = max(self._peak, rss_bytes())
            stats_tracker.scalar(
                **{f"memory/{name}_peak_gb": peak / 2**30, f"memory/{name}_page_faults": minor_page_faults() - faults}
            )
