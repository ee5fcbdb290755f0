"""Peak RSS per phase: a phase that allocates shows its peak, a later small one does not inherit it."""

from __future__ import annotations

import time

from megarl.utils import stats_tracker
from megarl.utils.memory import PeakRSS, rss_bytes


def test_each_phase_records_its_own_peak():
    stats_tracker.export()  # start clean
    memory = PeakRSS(interval=0.005)
    base = rss_bytes()
    with memory.peak("big"):
        block = bytearray(300 * 2**20)  # 300 MiB, touched: resident
        time.sleep(0.05)
        del block
    with memory.peak("small"):
        time.sleep(0.05)
    stats = stats_tracker.export()
    big, small = stats["memory/big_peak_gb"], stats["memory/small_peak_gb"]
    assert big * 2**30 >= base + 250 * 2**20
    assert small * 2**30 < base + 150 * 2**20, "the second phase does not inherit the first one's peak"
