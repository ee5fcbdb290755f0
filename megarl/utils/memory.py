"""Peak resident memory of this process, phase by phase (``memory/<phase>_peak_gb`` in the step stats)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
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


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``).

    A training step frees gigabytes of activations of varying sizes from many threads;
    glibc keeps much of that in its arenas, so without this the resident size of a CPU
    trainer creeps up step after step although nothing is alive.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


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
        """Record the peak RSS of the block as ``memory/<scopes>/<name>_peak_gb``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._sample, name="megarl-rss", daemon=True)
            self._thread.start()
        with self._lock:
            self._peak = rss_bytes()
        self._active.set()
        try:
            yield
        finally:
            self._active.clear()
            with self._lock:
                peak = max(self._peak, rss_bytes())
            stats_tracker.scalar(**{f"memory/{name}_peak_gb": peak / 2**30})
