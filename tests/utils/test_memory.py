"""Peak RSS per phase: a phase that allocates shows its peak, a later small one does not inherit it."""

from __future__ import annotations

import threading
import time

import pytest

from megarl.utils import memory as memory_module
from megarl.utils import stats_tracker
from megarl.utils.memory import PeakRSS, rss_bytes


@pytest.mark.parametrize("sampler_delay_s", [0.0, 0.3], ids=["idle", "sampler-waits-for-a-core"])
def test_each_phase_records_its_own_peak(monkeypatch, sampler_delay_s):
    """``sampler-waits-for-a-core``: each sample of the sampling thread comes 0.3 s late, as on a loaded
    machine where that thread waits for a core; the phases' peaks must not depend on it."""

    def late_in_the_sampler() -> int:
        if threading.current_thread().name == "megarl-rss":
            time.sleep(sampler_delay_s)
        return rss_bytes()

    monkeypatch.setattr(memory_module, "rss_bytes", late_in_the_sampler)
    stats_tracker.export()  # start clean
    memory = PeakRSS(interval=0.005)
    base = rss_bytes()
    with memory.peak("big"):
        block = bytearray(300 * 2**20)  # 300 MiB, zero-filled: resident
        # the block stays until the sampling thread has seen it, however long that thread waits for a
        # core (no fixed sleep is long enough on a loaded machine); one that never samples fails at the deadline
        deadline = time.monotonic() + 60
        while memory.peak_so_far() < base + 250 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.01)
        del block
    with memory.peak("small"):
        time.sleep(0.05)
    stats = stats_tracker.export()
    big, small = stats["memory/big_peak_gb"], stats["memory/small_peak_gb"]
    assert big * 2**30 >= base + 250 * 2**20
    assert small * 2**30 < base + 150 * 2**20, "the second phase does not inherit the first one's peak"
