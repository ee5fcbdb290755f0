"""Peak RSS per phase: a phase that allocates shows its peak, a later small one does not inherit it."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import threading
import time

import pytest

from megarl.utils import memory as memory_module
from megarl.utils import stats_tracker
from megarl.utils.memory import PeakRSS, rss_bytes


def _resident_block(size: int) -> mmap.mmap:
    """``size`` bytes of new pages, each written: resident, whatever the heap already holds (a heap that
    kept freed pages, as the CPU trainer's does, would serve a ``bytearray`` from pages already counted)."""
    block = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    return block


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
        block = _resident_block(300 * 2**20)
        # the block stays until the sampling thread has seen it, however long that thread waits for a
        # core (no fixed sleep is long enough on a loaded machine); one that never samples fails at the deadline
        deadline = time.monotonic() + 60
        while memory.peak_so_far() < base + 250 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.01)
        block.close()
    with memory.peak("small"):
        time.sleep(0.05)
    stats = stats_tracker.export()
    big, small = stats["memory/big_peak_gb"], stats["memory/small_peak_gb"]
    assert big * 2**30 >= base + 250 * 2**20
    assert small * 2**30 < base + 150 * 2**20, "the second phase does not inherit the first one's peak"


HEAP_BOUND = """
import json, sys
import torch
from megarl.utils import stats_tracker
from megarl.utils.memory import HeapBound, keep_freed_memory, rss_bytes

kept = sys.argv[1] == "kept" and keep_freed_memory()  # as the CPU trainer's main() does
bound, trims, rss = HeapBound(2.0), [], []  # margins for a heap that also fragments
for mib in json.loads(sys.argv[2]):  # each step's activations, freed at its end
    blocks = [torch.ones(mib << 16) for _ in range(4)]  # 4 tensors of mib / 4 MiB each
    del blocks
    bound.end_step()
    trims.append(stats_tracker.export().get("memory/heap_trims"))
    rss.append(rss_bytes())
print(json.dumps({"kept": kept, "trims": trims, "rss": rss, "settled": bound.settled_bytes}))
"""


def _heap_bound(mode: str, step_mib: list[int]) -> dict:
    argv = [sys.executable, "-c", HEAP_BOUND, mode, json.dumps(step_mib)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_kept_heap_goes_back_to_the_os_once_it_outgrows_its_bound():
    """``cluster.cpu_heap_growth``: a step that leaves the kept heap past 2x its size after the second
    step hands the free part back (the resident size falls by the 1.5 GiB it freed), steps within it keep
    their pages, and a process whose heap is not kept records nothing."""
    kept = _heap_bound("kept", [128, 128, 128, 1536, 128])
    assert kept["kept"], "glibc's mallopt took the settings"
    assert kept["trims"] == [0.0, 0.0, 0.0, 1.0, 1.0], kept
    settled, rss = kept["settled"], kept["rss"]
    assert abs(settled - rss[1]) < 64 * 2**20 and rss[2] > settled - 64 * 2**20, (
        "a step within the bound keeps the heap"
    )
    assert rss[3] < settled + 256 * 2**20, f"the 1.5 GiB freed in step 4 went back: {rss[3] / 2**20:.0f} MiB"
    assert _heap_bound("default", [256] * 5)["trims"] == [None] * 5, "not kept: no trims, no stat"


def test_a_kept_heap_settles_again_after_a_trim():
    """Batches that grew for good (1 GiB of activations a step from the third on) cost one trim, after
    which the bound is taken from the new working set: not a trim (and a phase of page faults) every step."""
    kept = _heap_bound("kept", [64, 64, 1024, 1024, 1024, 1024, 1024])
    assert kept["trims"] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], kept
    assert abs(kept["settled"] - kept["rss"][4]) < 64 * 2**20 and kept["settled"] > kept["rss"][1] + 512 * 2**20, kept
