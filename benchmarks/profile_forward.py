"""One shape of the fused logprob forward beside the bare cuBLAS GEMM, for a profiler.

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        python -m benchmarks.profile_forward --tokens 16384 --hidden 4096 --vocab 32768

Runs ``--repeats`` forwards of each (the fused kernel under ``MEGARL_CUDA_MAINLOOP``, then
``hidden @ weight.T``), after one warm-up each, and prints the CUDA-event time of each, so that
the profiler's per-kernel counters and the wall time come from the same launches.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from benchmarks.fused_logprob import _inputs, _step

    hidden, weight, labels = _inputs(args.tokens, args.hidden, args.vocab, torch.bfloat16, "cuda")
    flops = 2 * args.tokens * args.hidden * args.vocab
    for variant in ("cuda", "matmul"):  # warm-ups (the JIT build, the self-check) outside the range
        _step(variant, hidden, weight, labels, backward=False)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # `ncu --profile-from-start off` sees only the timed launches
    for variant in ("cuda", "matmul"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.repeats):
            _step(variant, hidden, weight, labels, backward=False)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.repeats
        print(
            f"{variant:7s} T={args.tokens} H={args.hidden} V={args.vocab}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s"
        )
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
