"""The fused forward's DRAM traffic by CTA order (``MEGARL_CUDA_CTA_GROUP``): a model of an H200's L2, not a
measurement.

Why a model: the one profile of the sm90 forward (``results/profile_forward_gpu_ncu.txt``, T=16384, H=4096,
V=32768) puts it on memory traffic: DRAM 69% busy for 7.79 ms, about 26 GB for 0.38 GiB of inputs, where
cuBLAS's GEMM moves about 5 GB. Each CTA owns one token block and one vocab split and walks the split's
tiles in turn; with the splits of a token block numbered first (group 1, the order the kernels had), the
CTAs that read the same weight tile start one wave apart, and the weight comes from DRAM again for each
token block. This script replays a launch in each order on a simple machine and counts what misses L2, so
that the default group (``kDefaultCtaGroup`` in ``csrc/kernels.h``) is chosen by more than a guess until a
GPU sweep (``python -m benchmarks.profile_forward --sweep``, in the prepared GPU call) measures it.

The machine: 132 SMs (an H200), one CTA per SM (the kernel's shared memory allows no more), started in
launch order as SMs free up (x fastest, then y, then z: ``csrc/cta_order.cuh``). A vocab tile takes one
time unit, drawn from 1 +- ``jitter`` per CTA and tile (SMs do not run in lockstep), plus a tenth of a
unit of epilogue; its K loop reads the token block's hidden rows and the tile's weight rows in
``K_EVENTS`` even steps. L2 is one LRU cache of ``l2_mb``: 50 MB (the whole L2) with SMs within 5%, or
25 MB (one of its two partitions, which is what an SM reads from near) with SMs within 25%. Real L2 is
neither, so read the columns as a range; what the model is for is the ratio between orders.
``vs_group_1``: the modelled traffic over group 1's at the same shape and setting. ``dram_ms``: that
traffic at the H200's 4.8 TB/s. Two checks against what the H200 measured in the old order: the profiled
shape's measured traffic (``measured_GB``) beside its modelled group 1, and at every shape the forward's
measured time (``measured_fwd_ms``, ``results/fused_logprob_gpu.json``'s ``cuda`` rows, group 1) beside
``dram_ms`` (``dram_vs_measured``): a model whose traffic took longer than the whole forward would be wrong.

    python -m benchmarks.cta_order_model [--quick]
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import OrderedDict
from pathlib import Path

from benchmarks._harness import RESULTS_DIR, main_for
from benchmarks.fused_logprob import GPU_SHAPES
from megarl.kernels._cuda import TILE, splits_for

TITLE = "Fused forward's DRAM traffic by CTA order (MEGARL_CUDA_CTA_GROUP): modelled on an H200's L2, not measured"
SMS = 132  # an H200's
SM90_TILE_VOCAB = 256  # kTileVocabSm90 (csrc/kernels.h); TILE token rows
K_EVENTS = 8
EPILOGUE = 0.1
GROUPS = (1, 4, 8, 16, 32, 64)
SETTINGS = {"L2 50 MB, SMs within 5%": (50, 0.05), "L2 25 MB, SMs within 25%": (25, 0.25)}
PROFILED = (16384, 4096, 32768)
DRAM_BYTES_PER_S = 4.8e12  # an H200's HBM3e
MEASURED_GB = round(0.6901 * DRAM_BYTES_PER_S * 7.79e-3 / 1e9, 1)
"""The profiled shape's DRAM traffic at group 1: ncu's DRAM throughput (69.01% of the H200's 4.8 TB/s) for
its 7.79 ms (``results/profile_forward_gpu_ncu.txt``, commit 59e9375)."""


def launch_order(cols: int, rows: int, group: int) -> list[tuple[int, int]]:
    """(column block, token block) of each CTA with a tile, in the order the GPU starts them
    (``grouped_grid`` of ``csrc/cta_order.cuh``)."""
    return [(c, r) for g0 in range(0, rows, group) for c in range(cols) for r in range(g0, min(g0 + group, rows))]


def dram_gb(T: int, H: int, V: int, group: int, l2_mb: float, jitter: float, seed: int = 0) -> float:
    """Modelled DRAM traffic (GB) of one sm90 forward over [T, H] x [V, H]^T in bf16 (module docstring)."""
    rnd = random.Random(seed)
    rows, tiles = math.ceil(T / TILE), math.ceil(V / SM90_TILE_VOCAB)
    splits = splits_for(T, V, SMS, SM90_TILE_VOCAB)
    per_split = math.ceil(tiles / splits)
    order = iter(launch_order(splits, rows, group))
    a_bytes, b_bytes = TILE * H * 2 // K_EVENTS, SM90_TILE_VOCAB * H * 2 // K_EVENTS
    cache: OrderedDict = OrderedDict()
    capacity, held, missed = l2_mb * 2**20, 0, 0

    def read(key, size: int) -> None:
        nonlocal held, missed
        if key in cache:
            cache.move_to_end(key)
            return
        missed += size
        cache[key] = size
        held += size
        while held > capacity:
            held -= cache.popitem(last=False)[1]

    running: list = []  # (time, sequence, row, tile, last tile, step, step length)
    sequence = 0

    def start(now: float) -> None:
        nonlocal sequence
        for split, row in order:
            first, last = split * per_split, min(tiles, (split + 1) * per_split)
            if first < last:  # an empty split (more splits than tiles) has nothing to read
                sequence += 1
                step = rnd.uniform(1 - jitter, 1 + jitter) / K_EVENTS
                heapq.heappush(running, (now, sequence, row, first, last, 0, step))
                return

    for _ in range(SMS):
        start(0.0)
    while running:
        now, seq, row, tile, last, step, length = heapq.heappop(running)
        read(("hidden", row, step), a_bytes)
        read(("weight", tile, step), b_bytes)
        now += length
        step += 1
        if step == K_EVENTS:
            now += EPILOGUE
            tile, step, length = tile + 1, 0, rnd.uniform(1 - jitter, 1 + jitter) / K_EVENTS
            if tile == last:
                start(now)
                continue
        heapq.heappush(running, (now, seq, row, tile, last, step, length))
    return missed / 1e9


def measured_forward_ms(results: Path = RESULTS_DIR / "fused_logprob_gpu.json") -> dict[tuple, float]:
    """The H200's forward time (median ms) of megarl's ``cuda`` rows at TP 1, by (T, H, V), from the
    committed results (run in the old CTA order); empty where there are none."""
    if not results.exists():
        return {}
    rows = json.loads(results.read_text())["rows"]
    return {
        (r["T"], r["H"], r["V"]): r["fwd_ms"]
        for r in rows
        if r.get("variant") == "cuda" and r.get("tp") == 1 and r.get("fwd_ms")
    }


def run(quick: bool) -> list[dict]:
    shapes = [(4096, 2048, 32768)] if quick else [PROFILED] + [s for s in GPU_SHAPES if s != PROFILED]
    groups = (1, 16) if quick else GROUPS
    measured = measured_forward_ms()
    rows = []
    for T, H, V in shapes:
        for setting, (l2_mb, jitter) in SETTINGS.items():
            traffic = {group: dram_gb(T, H, V, group, l2_mb, jitter) for group in groups}
            rows += [
                _row(T, H, V, setting, group, gb, traffic[1], measured.get((T, H, V))) for group, gb in traffic.items()
            ]
    return rows


def _row(T: int, H: int, V: int, setting: str, group: int, gb: float, group_1_gb: float, fwd_ms: float | None) -> dict:
    dram_ms = gb * 1e9 / DRAM_BYTES_PER_S * 1e3
    measured = fwd_ms if group == 1 else None  # the H200 ran the old order
    return {
        "T": T,
        "H": H,
        "V": V,
        "setting": setting,
        "group": group,
        "dram_GB": round(gb, 2),
        "inputs_GB": round((T + V) * H * 2 / 1e9, 3),
        "vs_group_1": round(gb / group_1_gb, 3),
        "dram_ms": round(dram_ms, 2),
        "measured_GB": MEASURED_GB if (T, H, V) == PROFILED and group == 1 else None,
        "measured_fwd_ms": None if measured is None else round(measured, 2),
        "dram_vs_measured": None if measured is None else round(dram_ms / measured, 3),
    }


def summary(rows: list[dict]) -> str:
    """The best group per setting, by the geometric mean of vs_group_1 over the shapes."""
    lines = []
    for setting in SETTINGS:
        by_group: dict[int, list[float]] = {}
        for row in rows:
            if row["setting"] == setting:
                by_group.setdefault(row["group"], []).append(row["vs_group_1"])
        means = {g: math.exp(sum(map(math.log, v)) / len(v)) for g, v in by_group.items()}
        best = min(means, key=means.get)
        worst = max(r["vs_group_1"] for r in rows if r["setting"] == setting and r["group"] == best)
        lines.append(
            f"{setting}: group {best} moves {means[best]:.2f}x group 1's DRAM traffic (geometric mean over "
            f"{len(by_group[best])} shapes; at most {worst:.2f}x)"
        )
    for setting in SETTINGS:
        shares = [r["dram_vs_measured"] for r in rows if r["setting"] == setting and r["dram_vs_measured"]]
        if shares:
            lines.append(
                f"{setting}: group 1's traffic at 4.8 TB/s takes {min(shares):.2f}-{max(shares):.2f} of the forward "
                f"the H200 measured ({len(shares)} shapes)"
            )
    return "; ".join(lines) + "."


if __name__ == "__main__":
    main_for(__name__)
