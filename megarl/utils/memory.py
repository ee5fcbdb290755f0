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
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``), e.g. before another process
    needs this machine's memory; not between a trainer's phases (:func:`keep_freed_memory`)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


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
