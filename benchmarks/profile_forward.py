"""One shape of the fused logprob forward beside the bare cuBLAS GEMM, for a profiler; and the sweep of
the forward's CTA order (``MEGARL_CUDA_CTA_GROUP``) over the TP-1 shapes.

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        python -m benchmarks.profile_forward --tokens 16384 --hidden 4096 --vocab 32768
    python -m benchmarks.profile_forward --sweep [--out DIR]

One shape: ``--repeats`` forwards of each (the fused kernel under ``MEGARL_CUDA_MAINLOOP`` and
``MEGARL_CUDA_CTA_GROUP``, then ``hidden @ weight.T``), after one warm-up each, and the CUDA-event time
of each, so that the profiler's per-kernel counters and the wall time come from the same launches.

``--sweep``: at each TP-1 shape of ``benchmarks/fused_logprob.py`` (bf16, the sm90 mainloop where it
runs), the fused forward in each CTA order of :data:`SWEEP_GROUPS` and the bare GEMM, each timed
``--repeats`` times (10) after a warm-up, two ways: ``op_ms`` (CUDA events around one call: the op as
the actor calls it, the split merge and the finalising elementwise kernels included; min / median /
max) and ``kernel_ms`` (``torch.profiler``'s device time of the GEMM kernel alone, per call: the
forward kernel against cuBLAS's, what ``kernel_vs_cublas`` divides). Rows go to
``DIR/profile_forward_gpu_sweep.{json,md}`` (default ``benchmarks/results``) as each shape ends.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

SWEEP_GROUPS = (1, 8, 16, 32, 64)
"""Token blocks per group (``csrc/cta_order.cuh``): 1 is the order before the knob, 32 the default up to H 4096."""
SWEEP_TITLE = "Fused forward by CTA order (MEGARL_CUDA_CTA_GROUP) against cuBLAS, TP-1 shapes: kernel and op time"
SWEEP_STEM = "profile_forward_gpu_sweep"
FORWARD_KERNEL = "logprob_forward"
"""What the fused forward kernel's name holds (both mainloops)."""


def kernel_times(fn, repeats: int = 1) -> dict[str, float]:
    """Device milliseconds per call of each CUDA kernel that ``repeats`` calls of ``fn`` ran (``torch.profiler``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return {
        event.key: (getattr(event, "self_device_time_total", None) or event.self_cuda_time_total) / 1e3 / repeats
        for event in prof.key_averages()
        if event.device_type == DeviceType.CUDA
    }


def _kernel_ms(fn, repeats: int, name: str | None) -> float:
    """Device time per call of the kernels whose name holds ``name`` (the costliest kernel when None)."""
    kernels = kernel_times(fn, repeats)
    return sum(t for key, t in kernels.items() if name in key) if name else max(kernels.values(), default=0.0)


def sweep_row(T: int, H: int, V: int, variant: str, op_times: list[float], kernel_ms: float) -> dict:
    """One row of the sweep: op time (min / median / max) and kernel time, with their TFLOP/s."""
    flops = 2 * T * H * V
    median = statistics.median(op_times)
    return {
        "T": T,
        "H": H,
        "V": V,
        "variant": variant,
        "op_ms": median,
        "op_ms_min": min(op_times),
        "op_ms_max": max(op_times),
        "kernel_ms": kernel_ms,
        "kernel_TFLOP/s": flops / (kernel_ms * 1e-3) / 1e12 if kernel_ms > 0 else None,
        "op_TFLOP/s": flops / (median * 1e-3) / 1e12,
    }


def with_ratios(rows: list[dict]) -> list[dict]:
    """``kernel_vs_cublas`` / ``op_vs_cublas``: cuBLAS's time at the row's shape over the row's (above 1: faster)."""
    cublas = {(r["T"], r["H"], r["V"]): r for r in rows if r["variant"] == "cublas"}
    for row in rows:
        base = cublas.get((row["T"], row["H"], row["V"]))
        if base is not None and row["variant"] != "cublas":
            row["kernel_vs_cublas"] = base["kernel_ms"] / row["kernel_ms"] if row["kernel_ms"] > 0 else None
            row["op_vs_cublas"] = base["op_ms"] / row["op_ms"]
    return rows


def sweep(shapes, repeats: int, groups=SWEEP_GROUPS, on_rows=None) -> list[dict]:
    """The rows of ``--sweep`` (module docstring); ``on_rows(rows)`` after each shape. An operator's
    ``MEGARL_CUDA_CTA_GROUP`` is set aside while it runs and put back after."""
    rows: list[dict] = []
    setting = os.environ.pop("MEGARL_CUDA_CTA_GROUP", None)
    try:
        for T, H, V in shapes:
            rows += _shape_rows(T, H, V, repeats, groups)
            with_ratios(rows)
            if on_rows is not None:
                on_rows(rows)
    finally:
        os.environ.pop("MEGARL_CUDA_CTA_GROUP", None)
        if setting is not None:
            os.environ["MEGARL_CUDA_CTA_GROUP"] = setting
    return rows


def _shape_rows(T: int, H: int, V: int, repeats: int, groups) -> list[dict]:
    """cuBLAS's row, then the fused forward's in each CTA order, at one shape."""
    from benchmarks import fused_logprob
    from megarl.kernels import _cuda

    hidden, weight, labels = fused_logprob._inputs(T, H, V, torch.bfloat16, "cuda")

    def op_times(variant: str) -> list[float]:  # fused_logprob's timing of a row's fwd_ms
        times = fused_logprob._measure_gpu(variant, hidden, weight, labels, False, repeats)[0]
        if times is None:
            raise torch.cuda.OutOfMemoryError(f"{variant} at T={T} H={H} V={V}")
        return times

    def gemm():
        fused_logprob._step("matmul", hidden, weight, labels, backward=False)

    def fused():
        fused_logprob._step("cuda", hidden, weight, labels, backward=False)

    rows = [sweep_row(T, H, V, "cublas", op_times("matmul"), _kernel_ms(gemm, repeats, None))]
    for group in groups:
        os.environ["MEGARL_CUDA_CTA_GROUP"] = str(group)
        row = sweep_row(T, H, V, f"cuda group {group}", op_times("cuda"), _kernel_ms(fused, repeats, FORWARD_KERNEL))
        row.update(
            group=group, default=group == _cuda.default_cta_group(H), kernel_path=_cuda.active_path(hidden.device)
        )
        rows.append(row)
    os.environ.pop("MEGARL_CUDA_CTA_GROUP", None)
    return rows  # the inputs go with this frame: the next shape's fit beside the cached blocks


def summary(rows: list[dict]) -> str:
    """Per group: the least and the median kernel_vs_cublas over the shapes."""
    parts = []
    for group in sorted({r["group"] for r in rows if "group" in r}):
        ratios = [r["kernel_vs_cublas"] for r in rows if r.get("group") == group and r.get("kernel_vs_cublas")]
        if ratios:
            parts.append(
                f"group {group}: kernel {min(ratios):.2f}-{max(ratios):.2f} of cuBLAS (median {statistics.median(ratios):.2f})"
            )
    return "; ".join(parts) + f" over {len({(r['T'], r['H'], r['V']) for r in rows})} shapes."


def _run_sweep(out: Path, repeats: int) -> None:
    import datetime

    from benchmarks._harness import machine_info, make_record, print_record, write_record
    from benchmarks.fused_logprob import GPU_SHAPES

    started, machine = datetime.datetime.now(datetime.UTC), machine_info()

    def write(rows: list[dict], partial: bool = True) -> dict:
        record = make_record("profile_forward", SWEEP_TITLE, list(rows), False, started, machine)
        if partial:
            record["partial"] = "the run ended before its last shape: these are the shapes it finished"
        record["summary"] = summary(rows)
        write_record(record, out, SWEEP_STEM, refresh_docs=False)
        return record

    rows = sweep(GPU_SHAPES, repeats, on_rows=write)
    print_record(write(rows, partial=False))


def _profile_one(tokens: int, hidden_size: int, vocab: int, repeats: int) -> None:
    from benchmarks.fused_logprob import _inputs, _step

    hidden, weight, labels = _inputs(tokens, hidden_size, vocab, torch.bfloat16, "cuda")
    flops = 2 * tokens * hidden_size * vocab
    for variant in ("cuda", "matmul"):  # warm-ups (the JIT build, the self-check) outside the range
        _step(variant, hidden, weight, labels, backward=False)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # `ncu --profile-from-start off` sees only the timed launches
    for variant in ("cuda", "matmul"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            _step(variant, hidden, weight, labels, backward=False)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / repeats
        print(f"{variant:7s} T={tokens} H={hidden_size} V={vocab}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
    torch.cuda.profiler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=None, help="3 for one shape, 10 for --sweep")
    parser.add_argument("--sweep", action="store_true", help="the CTA-order sweep over the TP-1 shapes")
    parser.add_argument("--out", type=Path, default=None, help="--sweep's results directory (benchmarks/results)")
    args = parser.parse_args()
    if args.sweep:
        from benchmarks._harness import RESULTS_DIR

        _run_sweep(args.out or RESULTS_DIR, args.repeats or 10)
    else:
        _profile_one(args.tokens, args.hidden, args.vocab, args.repeats or 3)


if __name__ == "__main__":
    main()
