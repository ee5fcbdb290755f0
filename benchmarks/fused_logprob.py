"""Fused logprob + entropy from hidden states: time, TFLOP/s and peak extra memory.

Variants per shape (T tokens, H hidden, V vocab):
  naive    matmul -> log_softmax -> gather ([T, V] fp32 logits materialised)
  chunked  megarl.kernels, torch path (chunks of 1024 tokens x 4096 vocab, fp32); its backward
           recomputes the logits: 8 T V H FLOPs executed for fwd+bwd
  train    the training path, megarl.kernels.linear_loss (gradients made in the forward; on CUDA
           the storing forward kernel + softmax_grad.cu + cuBLAS, elsewhere torch) with its default
           token chunks (on a GPU ~1 GiB of fp32 logits, elsewhere ~T H / V tokens): fwd+bwd only,
           6 T V H FLOPs executed
  train@liger  the same with the host's chunks of ~T H / V tokens (the GPU default before
           chunks were sized by memory; GPU only)
  train@4096   the same with chunks of 4096 tokens (GPU only)
  train_torch  the training path with torch's ops for the chunk's logits and dz (GPU only)
  cuda     megarl.kernels, CUDA kernels (GPU only; on Hopper the TMA + wgmma mainloop)
  cuda_sm80  the same kernels with the mma.sync mainloop forced (Hopper only, for comparison)
  liger    Liger-Kernel's fused linear cross entropy, summed (GPU only, when installed;
           it computes its gradients inside the forward, so only its fwd+bwd row is comparable)
  matmul   a bare [T,H] x [H,V] GEMM (fwd) and the three GEMMs of a linear layer's fwd+bwd:
           the ceiling
FLOPs are model FLOPs: 2 T V H for fwd, 6 T V H for fwd+bwd (recomputation not counted);
``bwd_recompute`` says which variants execute 2 T V H more (8 T V H in all).

On a GPU: bf16 inputs, CUDA-event timing (min / median / max of 10 repeats after a warm-up, 3
with --quick; the bare matmul's backward takes a random upstream gradient made before the
timing), peak extra memory = torch.cuda.max_memory_allocated during the call minus what was allocated before it
(inputs excluded, gradients included). Full grid T in {4k,16k,32k} x H in {2048,4096} x
V in {32k,152k} at TP 1, plus simulated TP shards (one rank's V/tp rows, no collectives).
``--grid train``: the TP-1 shapes with the bare matmul, the recompute path (``cuda``) and the
training path's variants only.

On CPU: fp32 inputs, naive vs chunked vs matmul at shapes two cores finish in about a minute
each (timings there are noisy on shared cores). Peak extra memory = peak RSS (ru_maxrss) of
a fresh process over its run minus its RSS after building the inputs, so allocator caching
cannot hide a peak; each (shape, variant) runs in its own process. ``extra/logits``
compares that with the fp32 [T, V] logits; ``grads_MiB`` is the part every fwd+bwd must
hold anyway (dW + dH).
"""

from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing
import os
import resource
import signal
import statistics
import time

import torch

from benchmarks._harness import main_for

TITLE = "Fused logprob + entropy: naive torch vs chunked torch vs CUDA kernel vs Liger vs bare matmul"

CPU_SHAPES_QUICK = [(256, 128, 2048)]
CPU_SHAPES = [(1024, 512, 32768), (512, 256, 152064)]
GPU_SHAPES_QUICK = [(4096, 2048, 32768)]
GPU_SHAPES = [(t, h, v) for t in (4096, 16384, 32768) for h in (2048, 4096) for v in (32768, 152064)]
GPU_TP_SHARDS = (4, 8)  # simulated shards, CUDA kernel and matmul only
MIB = 2**20
GPU_TRAIN_VARIANTS = ("train", "train@liger", "train@4096", "train_torch")
CLI_OPTIONS = {"--grid": ("MEGARL_FUSED_GRID", {"all": "all", "train": "train"})}
"""``--grid train``: the TP-1 shapes, matmul + cuda + the training path's variants only."""


def _inputs(T: int, H: int, V: int, dtype: torch.dtype, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(T, H, generator=g, device=device).to(dtype)
    weight = (torch.randn(V, H, generator=g, device=device) * H**-0.5).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g, device=device)
    return hidden, weight, labels


def _train_step(variant: str, h, w, labels, backward: bool) -> None:
    """A variant of the training path (``train``, ``train@liger``, ``train@N``, ``train_torch``)."""
    from megarl.kernels.linear_loss import default_chunk_tokens, fused_linear_token_loss

    chunks = variant.partition("@")[2]
    chunk_tokens = None
    if chunks == "liger":
        chunk_tokens = default_chunk_tokens(h.shape[0], w.shape[0], h.shape[1], on_gpu=False)
    elif chunks:
        chunk_tokens = int(chunks)
    backend = "torch" if variant == "train_torch" else "auto"
    os.environ["MEGARL_CUDA_MAINLOOP"] = "auto"
    token_loss = lambda t0, t1, lp, ent: lp + ent  # noqa: E731
    loss = fused_linear_token_loss(h, w, labels, token_loss, chunk_tokens=chunk_tokens, backend=backend)[0]
    if backward:
        loss.backward()


def _step(variant: str, hidden, weight, labels, backward: bool, upstream=None):
    """One forward (and backward) of a variant; returns nothing, frees its outputs. ``upstream``:
    the matmul's output gradient [T, V] (made outside the timing; ones when not given)."""
    from megarl.kernels import fused_logprobs_entropy, logprobs_entropy_naive

    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    if variant == "matmul":
        out = h @ w.T
        if backward:
            grad = torch.ones_like(out) if upstream is None else upstream
            _ = grad @ w, grad.T @ h
        return
    if variant == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, h, labels).backward()
        return
    if variant.startswith("train"):
        _train_step(variant, h, w, labels, backward)
        return
    if variant == "naive":
        logp, ent = logprobs_entropy_naive(h, w, labels)
    elif variant == "chunked":
        logp, ent = fused_logprobs_entropy(h, w, labels, backend="torch")
    else:
        os.environ["MEGARL_CUDA_MAINLOOP"] = "sm80" if variant == "cuda_sm80" else "auto"
        logp, ent = fused_logprobs_entropy(h, w, labels, backend="cuda")
    if backward:
        (logp.sum() + ent.sum()).backward()


def _row(device, T, H, V, variant, tp, passes: dict, elem_bytes: int) -> dict:
    row = {"device": device, "T": T, "H": H, "V": V, "tp": tp, "variant": variant}
    logits_mib = T * V * 4 / MIB
    for name, (times, extra_mib) in passes.items():
        flops = (2 if name == "fwd" else 6) * T * V * H
        ms = None if not times else statistics.median(times)
        row[f"{name}_ms"] = ms
        row[f"{name}_ms_min"] = None if not times else min(times)
        row[f"{name}_ms_max"] = None if not times else max(times)
        row[f"{name}_TFLOP/s"] = None if ms is None else flops / (ms * 1e-3) / 1e12
        row[f"{name}_extra_MiB"] = extra_mib
        row[f"{name}_extra/logits_%"] = None if extra_mib is None else 100 * extra_mib / logits_mib
    row["bwd_recompute"] = variant in ("chunked", "cuda", "cuda_sm80")
    row["fp32_logits_MiB"] = logits_mib
    row["grads_MiB"] = (V + T) * H * elem_bytes / MIB  # dW + dH, inside every fwd+bwd extra
    return row


# ---------------------------------------------------------------- CPU
def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _measure_cpu(variant: str, T: int, H: int, V: int, repeats: int) -> dict:
    """Runs in a fresh process: (times in ms, peak extra MiB) for fwd and fwd+bwd."""
    for backward in (False, True):  # lazy library set-up (BLAS buffers, autograd) outside the measurement
        _step(variant, *_inputs(16, 16, 64, torch.float32, "cpu"), backward)
    hidden, weight, labels = _inputs(T, H, V, torch.float32, "cpu")
    gc.collect()
    base = _rss_bytes()
    result = {}
    for name, backward in (("fwd", False), ("fwd+bwd", True)):
        if variant == "train" and not backward:  # it has no forward without gradients
            result[name] = (None, None)
            continue
        _step(variant, hidden, weight, labels, backward)  # cold run: sets the high-water mark
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _step(variant, hidden, weight, labels, backward)
            times.append((time.perf_counter() - start) * 1e3)
        result[name] = (times, max(0, peak - base) / MIB)
    return result


def _run_cpu(quick: bool) -> list[dict]:
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for T, H, V in CPU_SHAPES_QUICK if quick else CPU_SHAPES:
        for variant in ("naive", "chunked", "train", "matmul"):
            with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                passes = pool.submit(_measure_cpu, variant, T, H, V, 1 if quick else 2).result()
            rows.append(_row("cpu", T, H, V, variant, 1, passes, elem_bytes=4))
    _add_ceiling_ratios(rows)
    return rows


# ---------------------------------------------------------------- GPU
def _measure_gpu(variant: str, hidden, weight, labels, backward: bool, repeats: int):
    """(times in ms, peak extra MiB) of ``repeats`` calls after a warm-up; (None, None) when out of memory."""
    try:
        upstream = None
        if variant == "matmul" and backward:  # made here, outside the timing (and the peak)
            upstream = torch.randn(hidden.shape[0], weight.shape[0], device=hidden.device, dtype=hidden.dtype)
        _step(variant, hidden, weight, labels, backward, upstream)  # warm-up (and JIT build)
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(variant, hidden, weight, labels, backward, upstream)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times, (torch.cuda.max_memory_allocated() - base) / MIB
    except torch.cuda.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return None, None  # reported as an empty cell: out of memory


def _cuda_variants() -> list[str]:
    """The CUDA rows, the forced mma.sync mainloop first: a fault of the wgmma one cannot cost it."""
    from megarl.kernels import _cuda

    try:
        ext = _cuda.load_extension()
        return ["cuda_sm80", "cuda"] if ext is not None and ext.sm90_mainloop_available() else ["cuda"]
    except Exception:  # noqa: BLE001 (the cuda row then records the error)
        return ["cuda"]


def _gpu_variants() -> list[str]:
    """The bare matmul (the ceiling) and the torch paths first, then the kernels that could fault."""
    if os.environ.get("MEGARL_FUSED_GRID", "all") == "train":
        return ["matmul", "cuda", *GPU_TRAIN_VARIANTS]
    variants = ["matmul", "naive", "chunked"]
    try:
        import liger_kernel  # noqa: F401

        variants.append("liger")
    except ImportError:
        pass
    return [*variants, *_cuda_variants(), *GPU_TRAIN_VARIANTS]


class _Stopped(BaseException):  # not an Exception: the per-variant try must not swallow it
    """SIGTERM (the GPU kit's step budget ran out): the rows so far are the table."""


def _stop(signum, frame):
    raise _Stopped


def _gpu_row(device, T, H, V, tp, variant, inputs, repeats) -> dict:
    """One variant's row; an error (a failed build, a kernel fault) is recorded in it, not raised."""
    passes = {}
    try:
        for name, backward in (("fwd", False), ("fwd+bwd", True)):
            if (variant == "liger" or variant.startswith("train")) and not backward:
                passes[name] = (None, None)
            else:
                passes[name] = _measure_gpu(variant, *inputs, backward, repeats)
        return {**_row(device, T, H, V, variant, tp, passes, elem_bytes=2), **_path_taken(variant)}
    except Exception as exc:  # noqa: BLE001 (one variant's failure must not lose the others' rows)
        passes = {name: passes.get(name, (None, None)) for name in ("fwd", "fwd+bwd")}
        row = _row(device, T, H, V, variant, tp, passes, elem_bytes=2)
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return row


KERNEL_VARIANTS = ("cuda", "cuda_sm80", "train", "train@liger", "train@4096")


def _path_taken(variant: str) -> dict:
    """For a variant that runs megarl's kernels: the path its calls took ("sm90", "sm80" or
    "torch": a mainloop that failed its self-check falls back) and the self-check's verdict, so
    that a row labelled ``cuda`` never hides a fallback."""
    if variant not in KERNEL_VARIANTS:
        return {}
    from megarl.kernels import _cuda

    try:
        device = torch.device("cuda", torch.cuda.current_device())
        return {
            "kernel_path": _cuda.active_path(device) or "torch",
            "selfcheck": _cuda.verified_path(device).describe(),
        }
    except Exception as exc:  # noqa: BLE001 (the row's timings stand; say why the path is unknown)
        return {"kernel_path": None, "selfcheck": f"unknown: {type(exc).__name__}: {exc}"[:300]}


def _run_gpu(quick: bool, on_rows=None) -> list[dict]:
    rows = []
    device = torch.cuda.get_device_name(0)
    repeats = 3 if quick else 10
    only_train = os.environ.get("MEGARL_FUSED_GRID", "all") == "train"
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        for T, H, V in GPU_SHAPES_QUICK if quick else GPU_SHAPES:
            for tp in (1, *(() if quick or only_train else GPU_TP_SHARDS)):
                inputs = _inputs(T, H, V // tp, torch.bfloat16, "cuda")
                for variant in _gpu_variants() if tp == 1 else ["matmul", *_cuda_variants()]:
                    rows.append(_gpu_row(device, T, H, V // tp, tp, variant, inputs, repeats))
                    _add_ceiling_ratios(rows)
                    if on_rows is not None:
                        on_rows(rows)
                del inputs
    except _Stopped:
        rows.append({"device": device, "error": "stopped by SIGTERM (the step's time ran out): the rows above"})
    finally:
        signal.signal(signal.SIGTERM, previous)
    _add_ceiling_ratios(rows)
    return rows


def _add_ceiling_ratios(rows: list[dict]) -> None:
    """vs_matmul = TFLOP/s relative to the bare matmul of the same shape (targets: fwd >= 0.85,
    fwd+bwd >= 0.75); for the training path's rows, ``fwd+bwd_vs_cuda``: the recompute path's
    (``cuda``) fwd+bwd time over the row's (above 1: the training path is faster)."""
    by_variant = {(r.get("variant"), r.get("T"), r.get("H"), r.get("V")): r for r in rows}
    for r in rows:
        if "T" not in r:  # the note of a stopped run
            continue
        ceiling = by_variant.get(("matmul", r["T"], r["H"], r["V"]))
        for name in ("fwd", "fwd+bwd"):
            ours, best = r.get(f"{name}_TFLOP/s"), ceiling and ceiling.get(f"{name}_TFLOP/s")
            r[f"{name}_vs_matmul"] = ours / best if ours and best else None
        if r["variant"].startswith("train"):
            recompute = by_variant.get(("cuda", r["T"], r["H"], r["V"]), {}).get("fwd+bwd_ms")
            r["fwd+bwd_vs_cuda"] = recompute / r["fwd+bwd_ms"] if recompute and r.get("fwd+bwd_ms") else None


def summary(rows: list[dict]) -> str:
    """The training path (default chunks) against the recompute path, over the shapes measured."""
    ratios = [r["fwd+bwd_vs_cuda"] for r in rows if r.get("variant") == "train" and r.get("fwd+bwd_vs_cuda")]
    if not ratios:
        return "No shape with both a training-path and a recompute-path (cuda) time."
    return (
        f"Training path (default chunks) over the recompute path (cuda), fwd+bwd: {min(ratios):.2f}x to"
        f" {max(ratios):.2f}x as fast at {len(ratios)} shapes ({sum(x >= 1 for x in ratios)} at or above 1)."
    )


def results_name() -> str:
    """GPU and CPU tables, and the GPU's ``--grid train``, are different experiments: none overwrites another."""
    if not torch.cuda.is_available():
        return "fused_logprob"
    return "fused_logprob_gpu_train" if os.environ.get("MEGARL_FUSED_GRID", "all") == "train" else "fused_logprob_gpu"


def run(quick: bool, on_rows=None) -> list[dict]:
    """Benchmark rows: GPU grid when CUDA is available (each row handed to ``on_rows`` as it
    finishes), else the CPU comparison."""
    return _run_gpu(quick, on_rows) if torch.cuda.is_available() else _run_cpu(quick)


if __name__ == "__main__":
    main_for(__name__)
