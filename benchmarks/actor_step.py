"""Actor train step: tokens/s of MegatronEngine.train_batch, vs a plain HF step (CPU) or as MFU (GPU).

One process, one rank (``megatron:d1p1t1``; gloo on CPU, NCCL on CUDA), a random Qwen2-shaped
model (QKV bias, GQA, SwiGLU) whose size is set by the shape table below. A step is a packed
micro-batch pass of a token-mean next-token loss through the head's training path (the one
the PPO loss takes: ``LMHeadOutput.token_loss``, the head's gradients computed in its forward),
backward, and an Adam update. Timings: median over ``steps`` after one warm-up step (on CPU megarl's and
HF's steps take turns).

* CPU (fp32; bf16 too where the CPU computes it natively, or as ``--dtype`` asks): the same model as an HF
  transformers ``Qwen2ForCausalLM`` doing forward, log-softmax logprobs, backward and
  ``torch.optim.AdamW`` over the same tokens in the same dtype (bf16: bf16 weights and Adam
  states, where megarl keeps fp32 main weights), in the same process; ``vs_hf`` = Megatron
  tokens/s over HF tokens/s. Where a GRPO step's train phase spends its time, part by part,
  is ``benchmarks/train_phase.py``'s table. One table per CPU kind (``actor_step_avx2``,
  ``actor_step_avx512``, ``actor_step_avx512_bf16``, ``actor_step_amx``).
* GPU (bf16, Megatron's mixed-precision distributed optimizer): a Qwen2.5-1.5B-shaped model
  from random init, first with the torch path (``use_fused_kernels=False``), then with the fused
  CUDA logprob kernels (True), each in its own process (a kernel fault cannot cost the other
  row; a failed one is a row with its ``error``); each row gives step time, MFU and peak GPU
  memory. MFU =
  model FLOPs per second over the dense bf16 peak (989 TFLOP/s for H100/H200 SXM), with 6 N
  FLOPs per token for the N non-embedding + LM-head parameters plus causal attention 6 L S h
  (forward 2 + backward 4, halved for causality, times 2 matmuls; :mod:`megarl.models.flops`);
  ``MFU_megatron`` counts attention as Megatron-LM does, 12 L S h (the full score matrix). The first engine's weights
  are exported to HF and loaded into ``Qwen2ForCausalLM`` (same dtype, same device): the
  ``logp_max_abs_diff`` / ``logp_mean_abs_diff`` columns compare its next-token logprobs with
  ``compute_logp`` on the first two sequences (on the GPU, every row: fused kernels on and off).

``python -m benchmarks.actor_step [--quick] [--dtype both|bfloat16|float32]`` runs it here; on a GPU
``--shape NAME`` runs one shape (into ``actor_step_gpu_NAME``), ``--fused off|on|stock|on,stock|off,on,stock`` those
rows (``stock``: stock Megatron-LM's head, bf16 logits and ``vocab_parallel_cross_entropy``, a row a Megatron user
can compare with) and ``--profile on`` adds the top 20 kernels of one step after each row, with the share of
each kind (GEMM, attention, head, optimizer, elementwise);
``python -m benchmarks.actor_step --kit OUTDIR`` is the GPU kit's step
(``benchmarks/gpu_kit.sh``): it runs the GPU rows (the 4-layer shape with ``--quick``) and
writes ``actor_step_gpu.{json,md}`` to OUTDIR.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._harness import DTYPE_CHOICES, cpu_dtypes_to_run, cpu_kind, main_for
from megarl.models.flops import PEAK_BF16_TFLOPS, MatmulShape, train_flops

TITLE = "Actor train step: Megatron train_batch tokens/s vs HF forward+backward (CPU); MFU (GPU)"

# name: (hidden, layers, heads, kv_heads, intermediate, vocab, sequences, seq_len)
CPU_SHAPES_QUICK = {"tiny": (128, 2, 4, 2, 256, 4096, 4, 128)}
CPU_SHAPES = {"small": (512, 4, 8, 4, 1408, 32000, 8, 512)}
GPU_SHAPES_QUICK = {"qwen2.5-1.5b-4L": (1536, 4, 12, 2, 8960, 151936, 16, 2048)}
GPU_SHAPES = {
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, 16, 2048),
    # 4 of Qwen2.5-7B's 28 layers with its full vocabulary: the per-layer rate that the planner's
    # trainer figures (benchmarks/plan_rates_h100_qwen2.5-7b.yaml) assume
    "qwen2.5-7b-4L": (3584, 4, 28, 4, 18944, 152064, 16, 2048),
}
PEAK_BF16_FLOPS = PEAK_BF16_TFLOPS["H200"] * 1e12  # the H100 / H200 SXM dense bf16 peak
# Tokens per micro-batch where one micro-batch of the whole step does not fit: the 28-layer shape's
# 32,768 tokens in one micro-batch ran out of an H200's 139 GiB (activations, no recompute).
GPU_MB_TOKENS = {"qwen2.5-1.5b": 8192, "qwen2.5-7b-4L": 16384}


def _write_config(out: Path, shape: tuple) -> None:
    from transformers import AutoConfig

    hidden, layers, heads, kv, inter, vocab, _, seq_len = shape
    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=max(4096, seq_len),
        tie_word_embeddings=False,
    )
    config.save_pretrained(out)


def _batch(shape: tuple, device: str) -> dict:
    vocab, n, seq_len = shape[5], shape[6], shape[7]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, seq_len), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones(n, seq_len, dtype=torch.bool)}


def _nll(head, mb: dict) -> torch.Tensor:
    """Token-mean NLL through the head's training path (``LMHeadOutput.token_loss``, as the PPO loss
    does): the head's gradients come out of its forward, 6·T·V·H FLOPs, no logits recomputed."""
    mask = mb["label_mask"]
    count = mask.sum().clamp(min=1)
    loss, _, _ = head.token_loss(mb["labels"], lambda t0, t1, logp, entropy: -logp / count, 1.0, where=mask)
    return loss


def _nll_stock(head, mb: dict) -> torch.Tensor:
    """The same token-mean NLL as a stock Megatron-LM GPT step computes it: the output layer's bf16
    logits ``[T, V]`` (one rank: ColumnParallelLinear is a matmul), then
    ``tensor_parallel.vocab_parallel_cross_entropy`` (fp32 inside), as ``compute_language_model_loss``
    does without TE's fused cross entropy. Every logit exists, and autograd keeps them for the backward."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = head.hidden @ head.weight.t()
    nll = vocab_parallel_cross_entropy(logits[:, None], mb["labels"][:, None])[:, 0]
    mask = mb["label_mask"]
    return (nll * mask).sum() / mask.sum().clamp(min=1)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_steps(step, steps: int) -> tuple[list[float], object]:
    """(seconds of each of ``steps`` runs of ``step``, what its warm-up run returned)."""
    first = step()
    times = []
    for _ in range(steps):
        _sync()
        start = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - start)
    return times, first


def _engine(model_dir: Path, batch: dict, dtype: str, fused: bool | None, parallel=None, mb_tokens=None):
    """An initialised one-rank MegatronEngine from random weights (``parallel`` reuses the groups);
    the batch is one micro-batch unless ``mb_tokens`` caps it."""
    from megarl.actor.engine import MegatronEngine
    from megarl.actor.parallel import seed_everything
    from megarl.config.train import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from megarl.utils.network import find_free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    tokens = int(batch["attention_mask"].sum())
    cfg = TrainEngineConfig(
        path=str(model_dir),
        dtype=dtype,
        init_from_scratch=True,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=min(tokens, mb_tokens or tokens)),
        optimizer=OptimizerConfig(lr=1e-5, use_distributed_optimizer=True),
        use_fused_kernels=fused,
    )
    engine = MegatronEngine(cfg)
    if parallel is None:
        engine.create_process_group("d1p1t1")  # seeds the RNGs
    else:
        seed_everything(1, parallel)  # as the first engine was: every row trains the same initial weights
    engine.initialize(parallel=parallel)
    return engine


def _train_step(engine, batch: dict, loss_fn=_nll):
    weight = lambda mb: mb["label_mask"].sum()
    return lambda: engine.train_batch(batch, loss_fn, weight)


def _time_alternating(steps_of: dict, steps: int) -> dict[str, float]:
    """Median seconds of each named step, the steps run in turns (a, b, a, b, ...) after one warm-up
    each, so that a machine that slows down or speeds up during the run slows both alike."""
    for step in steps_of.values():
        step()
    times = {name: [] for name in steps_of}
    for _ in range(steps):
        for name, step in steps_of.items():
            _sync()
            start = time.perf_counter()
            step()
            _sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _hf_step(model_dir: Path, batch: dict, dtype: torch.dtype = torch.float32):
    """A plain HF training step over ``batch`` (forward, log-softmax logprobs, backward, AdamW)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = batch["input_ids"]

    def step():
        logits = model(ids).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])
        (-logp.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _flops_per_token(shape: tuple, convention: str = "causal") -> float:
    """Model FLOPs per token of a step over ``shape`` (:mod:`megarl.models.flops`)."""
    hidden, layers, heads, kv, inter, vocab, sequences, seq_len = shape
    matmuls = MatmulShape(hidden, layers, heads, kv, hidden // heads, inter, vocab)
    return train_flops(matmuls, [seq_len], convention) / seq_len


def mfu(
    shape: tuple, step_s: float, peak_flops: float = PEAK_BF16_FLOPS, convention: str = "causal"
) -> tuple[float, float]:
    """(model TFLOP/s, MFU) of one step over ``shape``'s sequences x seq_len tokens in ``step_s``;
    ``convention="megatron"`` counts attention's full score matrix, as Megatron-LM's MFU does."""
    if step_s <= 0:
        raise ValueError(f"step_s must be positive, got {step_s}")
    flops = _flops_per_token(shape, convention) * shape[6] * shape[7] / step_s
    return flops / 1e12, flops / peak_flops


def _row(name: str, shape: tuple, impl: str, step_s: float, **extra) -> dict:
    tokens = shape[6] * shape[7]
    return {"shape": name, "impl": impl, "tokens/step": tokens, "step_s": step_s, "tokens/s": tokens / step_s, **extra}


def gpu_row(
    name: str,
    shape: tuple,
    fused: bool | None,
    step_s: float,
    peak_gib: float,
    logp_gap=None,
    step_times: list[float] | None = None,
    head: str = "megarl",
) -> dict:
    """A GPU table row: step time (the median of ``step_times`` when given, with their min and max),
    tokens/s, TFLOP/s, MFU, peak memory, and the logprob gap to HF. ``head``: ``megarl`` (its training
    path, the fused kernels on or off) or ``megatron`` (stock Megatron-LM's: :func:`_nll_stock`)."""
    tflops, util = mfu(shape, step_s)
    megatron_util = mfu(shape, step_s, convention="megatron")[1]
    row = _row(name, shape, "megatron", step_s, head=head, fused_kernels=fused, **{"TFLOP/s": tflops, "MFU": util})
    if step_times:
        row["step_s_min"], row["step_s_max"] = min(step_times), max(step_times)
    row["MFU_megatron"] = megatron_util
    row["peak_GiB"] = peak_gib
    if logp_gap is not None:
        row["logp_max_abs_diff"], row["logp_mean_abs_diff"] = logp_gap
    return row


def logprob_gap(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(max, mean) |ours - theirs| over the masked-in positions of two [B, S] logprob tensors."""
    if ours.shape != theirs.shape or ours.shape != mask.shape:
        raise ValueError(f"logprob shapes differ: {tuple(ours.shape)}, {tuple(theirs.shape)}, mask {tuple(mask.shape)}")
    diff = (ours.double() - theirs.double()).abs()[mask.bool()]
    return (float(diff.max()), float(diff.mean())) if diff.numel() else (0.0, 0.0)


def _hf_logp(model_dir: Path, batch: dict, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Next-token logprobs [B, S] of an HF model directory (0 in the last column), as compute_logp."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = batch["input_ids"].to(device)
    out = torch.zeros(ids.shape, dtype=torch.float32)
    with torch.no_grad():
        for i in range(ids.shape[0]):  # one sequence at a time: fp32 logits [S, V] stay small
            logits = model(ids[i : i + 1]).logits[0, :-1].float()
            out[i, :-1] = logits.log_softmax(-1).gather(-1, ids[i, 1:, None])[:, 0].cpu()
    return out


def _hf_gap(engine, batch: dict, dtype: torch.dtype, device: str) -> tuple[float, float]:
    """The engine's compute_logp against HF transformers with the same weights, first two sequences."""
    few = {k: v[:2] for k, v in batch.items()}
    with tempfile.TemporaryDirectory() as tmp:
        engine.export_hf(tmp, dtype)
        theirs = _hf_logp(Path(tmp), few, dtype, device)
    ours = engine.compute_logp(few).float()
    mask = few["attention_mask"].clone()
    mask[:, -1] = False  # no next token after the last
    return logprob_gap(ours, theirs, mask)


def _path_taken(engine) -> dict:
    """What the engine's logprob kernels ran: ``kernel_path`` "sm90", "sm80" or "torch" (a
    mainloop that failed its self-check falls back, and the row says so) and the verdict."""
    from megarl.kernels import kernel_summary

    return {"kernel_path": engine.fused_kernel_path(), "selfcheck": kernel_summary(engine.kernel_backend)}


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


STOCK = "stock"
"""In ``heads``: stock Megatron-LM's head (:func:`_nll_stock`) instead of megarl's."""


def actor_rows(
    name: str, shape: tuple, dtype: str, steps: int, heads=(False, True), profile: bool = False
) -> list[dict]:
    """One row per head: ``use_fused_kernels`` False / True / None (megarl's training path) or
    :data:`STOCK`: step time (median, min, max), MFU, peak memory, the first step's loss (before any
    update: the same weights in every row); the first row also carries the logprob gap to HF
    transformers with the same weights. ``profile``: after each row, the top kernels of one step
    (:func:`profile_rows`, on a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, parallel = [], None
    with tempfile.TemporaryDirectory() as tmp:
        _write_config(Path(tmp), shape)
        batch = _batch(shape, device)
        for i, which in enumerate(heads):
            stock = which == STOCK
            fused = False if stock else which
            _reset_peak()
            engine = _engine(Path(tmp), batch, dtype, fused, parallel, GPU_MB_TOKENS.get(name))
            parallel = engine.parallel
            step = _train_step(engine, batch, _nll_stock if stock else _nll)
            times, first = _time_steps(step, steps)
            peak = _peak_gib()
            gap = _hf_gap(engine, batch, getattr(torch, dtype), device) if i == 0 else None
            head = "megatron" if stock else "megarl"
            row = gpu_row(name, shape, None if stock else fused, statistics.median(times), peak, gap, times, head)
            rows.append(row | {"first_loss": float(first["loss"])} | _path_taken(engine))
            if profile and device == "cuda":
                rows += profile_rows(name, head, fused, step)
            engine.destroy()
            del engine
    return rows


KERNEL_KINDS = (  # (kind, what its kernels' names hold), first match wins
    ("head", ("logprob", "softmax_grad", "cross_entropy", "crossentropy", "ppo_loss")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "softmax")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "matmul", "sm90_", "sm80_")),
    ("optimizer", ("adam", "multi_tensor", "optimizer")),
    ("communication", ("nccl",)),
    ("memory", ("memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    """What a CUDA kernel does, from its name: :data:`KERNEL_KINDS`, else ``elementwise/other``."""
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "elementwise/other")


def profile_rows(name: str, head: str, fused: bool | None, step, top: int = 20) -> list[dict]:
    """The ``top`` CUDA kernels of one step by device time (``impl`` "profile"), each with its kind
    (:func:`kernel_kind`) and share of the step's kernel time: where a step's time goes."""
    from benchmarks.profile_forward import kernel_times

    return top_kernel_rows(name, head, fused, kernel_times(step), top)


def top_kernel_rows(name: str, head: str, fused: bool | None, kernels: dict[str, float], top: int) -> list[dict]:
    """Rows of the ``top`` kernels of ``kernels`` (name: ms), and one per kind over all of them."""
    total = sum(kernels.values()) or 1.0
    base = {"shape": name, "impl": "profile", "head": head, "fused_kernels": fused}
    ranked = sorted(kernels.items(), key=lambda kv: kv[1], reverse=True)
    rows = [base | {"kernel": k[:120], "kind": kernel_kind(k), "ms": ms, "share": ms / total} for k, ms in ranked[:top]]
    by_kind: dict[str, float] = {}
    for kernel, ms in kernels.items():
        by_kind[kernel_kind(kernel)] = by_kind.get(kernel_kind(kernel), 0.0) + ms
    return rows + [
        base | {"kernel": f"all {kind}", "kind": kind, "ms": ms, "share": ms / total} for kind, ms in by_kind.items()
    ]


def _run_cpu(quick: bool) -> list[dict]:
    rows = []
    for name, shape in (CPU_SHAPES_QUICK if quick else CPU_SHAPES).items():
        for dtype in cpu_dtypes_to_run(DTYPES_ENV):
            with tempfile.TemporaryDirectory() as tmp:
                _write_config(Path(tmp), shape)
                batch = _batch(shape, "cpu")
                megarl_step = _train_step(_engine(Path(tmp), batch, dtype, None), batch)
                hf_step = _hf_step(Path(tmp), batch, getattr(torch, dtype))
                times = _time_alternating({"megatron": megarl_step, "hf": hf_step}, 2 if quick else 7)
                mcore, hf = times["megatron"], times["hf"]
            rows.append(_row(name, shape, "megatron", mcore, vs_hf=hf / mcore, dtype=dtype))
            rows.append(_row(name, shape, "hf", hf, dtype=dtype))
    return rows


DTYPES_ENV = "MEGARL_ACTOR_STEP_DTYPES"
"""Set by ``--dtype``: the CPU dtypes to time, comma-separated."""
SHAPE_ENV = "MEGARL_ACTOR_STEP_SHAPE"
"""Set by ``--shape``: the one GPU shape to run (its rows go to ``actor_step_gpu_SHAPE``)."""
FUSED_ENV = "MEGARL_ACTOR_STEP_FUSED"
"""Set by ``--fused``: the GPU rows of each shape, comma-separated, in order: ``off`` (megarl's head on
the torch path), ``on`` (on the fused kernels), ``stock`` (stock Megatron-LM's head); default ``off,on``."""
FUSED_CHOICES = ("off", "on", "stock", "off,on", "on,stock", "off,on,stock")
PROFILE_ENV = "MEGARL_ACTOR_STEP_PROFILE"
"""Set by ``--profile on``: after each GPU row, the top 20 kernels of one step and each kind's share."""
CLI_OPTIONS = {
    "--dtype": (DTYPES_ENV, DTYPE_CHOICES),
    "--shape": (SHAPE_ENV, {name: name for name in {**GPU_SHAPES_QUICK, **GPU_SHAPES}}),
    "--fused": (FUSED_ENV, {choice: choice for choice in FUSED_CHOICES}),
    "--profile": (PROFILE_ENV, {"on": "1"}),
}


def _gpu_shapes(quick: bool) -> dict[str, tuple]:
    """The GPU shapes to run: ``--shape``'s one, else the quick or the full set."""
    chosen = os.environ.get(SHAPE_ENV)
    if chosen:
        return {chosen: {**GPU_SHAPES_QUICK, **GPU_SHAPES}[chosen]}
    return GPU_SHAPES_QUICK if quick else GPU_SHAPES


def _heads() -> tuple:
    """``--fused``'s rows as :func:`actor_rows` takes them; by default the torch path first, then the
    kernels (a kernel fault must not cost the other row)."""
    chosen = os.environ.get(FUSED_ENV) or "off,on"
    if chosen not in FUSED_CHOICES:
        raise ValueError(f"{FUSED_ENV} must be one of {FUSED_CHOICES}, got {chosen!r}")
    return tuple({"off": False, "on": True, "stock": STOCK}[part] for part in chosen.split(","))


def _run_gpu(quick: bool, on_rows=None) -> list[dict]:
    rows = []
    profile = os.environ.get(PROFILE_ENV) == "1"
    for name, shape in _gpu_shapes(quick).items():
        for which in _heads():
            rows += _rows_in_own_process(name, shape, which, 3 if quick else 5, profile)
            if on_rows is not None:  # written now: a step budget that ends the next row keeps this one
                on_rows(rows)
    return rows


def _rows_in_own_process(name: str, shape: tuple, which, steps: int, profile: bool) -> list[dict]:
    """One GPU row (and its profile's) in a fresh process (own CUDA context and process group); an
    error, the process's death included, becomes the row's ``error``."""
    ctx = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            return pool.submit(actor_rows, name, shape, "bfloat16", steps, (which,), profile).result()
    except Exception as exc:  # noqa: BLE001 (BrokenProcessPool included)
        stock = which == STOCK
        return [
            {
                "shape": name,
                "impl": "megatron",
                "head": "megatron" if stock else "megarl",
                "fused_kernels": None if stock else which,
                "error": f"{type(exc).__name__}: {exc}"[:300],
            }
        ]


def results_name() -> str:
    """The GPU table (MFU, fused on/off) and the CPU ones (vs HF) are different experiments; the
    CPU kinds (:func:`~benchmarks._harness.cpu_kind`) differ most in bf16, so each has its own table."""
    if not torch.cuda.is_available():
        return f"actor_step_{cpu_kind()}"
    return f"actor_step_gpu_{os.environ[SHAPE_ENV]}" if os.environ.get(SHAPE_ENV) else "actor_step_gpu"


def run(quick: bool, on_rows=None) -> list[dict]:
    """CPU comparison with HF, or GPU MFU when CUDA is available (each GPU row handed to
    ``on_rows`` as it finishes)."""
    return _run_gpu(quick, on_rows) if torch.cuda.is_available() else _run_cpu(quick)


def kit_main(argv: list[str] | None = None) -> int:
    """The GPU kit's actor step: the GPU rows into OUTDIR/actor_step_gpu.{json,md}."""
    parser = argparse.ArgumentParser(description="the Megatron actor on CUDA, for benchmarks/gpu_kit.sh")
    parser.add_argument("--kit", type=Path, required=True, metavar="OUTDIR", help="where the table goes")
    parser.add_argument("--quick", action="store_true", help="the 4-layer Qwen2.5-1.5B-shaped model")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("actor_step --kit needs a CUDA GPU (torch.cuda.is_available() is False)")
    from benchmarks._harness import print_record, run_benchmark

    print_record(run_benchmark("actor_step", quick=args.quick, results_dir=args.kit))
    return 0


if __name__ == "__main__":
    if "--kit" in sys.argv:
        sys.exit(kit_main())
    main_for(__name__)
