"""Matrix-product speed of torch on this CPU in fp32 and in bf16.

Why ``dtype: auto`` is fp32 on a CPU without native bf16 (AVX-512 BF16 or AMX): there torch's bf16
matmul is emulated and far slower than fp32. One square product of ``N x N`` matrices
(``2 N^3`` flops) on every core, timed after a warm-up; the best of a few repetitions.
"""

from __future__ import annotations

import time

import torch

from benchmarks._harness import cpu_kind, main_for

TITLE = "torch matmul on CPU: fp32 vs bf16 GFLOP/s (N x N @ N x N, every core)"


def gflops(dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up: oneDNN picks and caches its kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def results_name() -> str:
    """One table per CPU kind (``bf16_matmul_avx2``, ``bf16_matmul_avx512``, ...): how slow emulated bf16
    is depends on the instructions the emulation has (AVX2 or AVX-512)."""
    return f"bf16_matmul_{cpu_kind()}"


def run(quick: bool) -> list[dict]:
    n, repeats = (256, 2) if quick else (1024, 3)
    rows = [
        {"dtype": name, "N": n, "threads": torch.get_num_threads(), "GFLOP/s": gflops(dtype, n, repeats)}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    ]
    for row in rows:
        row["vs fp32"] = row["GFLOP/s"] / rows[0]["GFLOP/s"]
    return rows


def summary(rows: list[dict]) -> str:
    fp32, bf16 = rows[0]["GFLOP/s"], rows[1]["GFLOP/s"]
    return f"bf16 is {fp32 / bf16:.1f}x slower than fp32 here" if fp32 >= bf16 else f"bf16 is {bf16 / fp32:.1f}x faster"


if __name__ == "__main__":
    main_for(__name__)
