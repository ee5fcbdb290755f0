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
``--shape NAME`` runs one shape (into ``actor_step_gpu_NAME``) and ``--fused on|off`` one of its rows;
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_steps(step, steps: int) -> float:
    """Median seconds of ``step`` over ``steps`` runs after one warm-up run."""
    return _time_alternating({"step": step}, steps)["step"]


def _engine(model_dir: Path, batch: dict, dtype: str, fused: bool | None, parallel=None, mb_tokens=None):
    """An initialised one-rank MegatronEngine from random weights (``parallel`` reuses the groups);
    the batch is one micro-batch unless ``mb_tokens`` caps it."""
    from megarl.actor.engine import MegatronEngine
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
        engine.create_process_group("d1p1t1")
    engine.initialize(parallel=parallel)
    return engine


def _train_step(engine, batch: dict):
    weight = lambda mb: mb["label_mask"].sum()
    return lambda: engine.train_batch(batch, _nll, weight)


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


def gpu_row(name: str, shape: tuple, fused: bool | None, step_s: float, peak_gib: float, logp_gap=None) -> dict:
    """A GPU table row: step time, tokens/s, TFLOP/s, MFU, peak memory, and the logprob gap to HF."""
    tflops, util = mfu(shape, step_s)
    megatron_util = mfu(shape, step_s, convention="megatron")[1]
    row = _row(name, shape, "megatron", step_s, fused_kernels=fused, **{"TFLOP/s": tflops, "MFU": util})
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


def actor_rows(name: str, shape: tuple, dtype: str, steps: int, fused_flags=(False, True)) -> list[dict]:
    """One row per ``use_fused_kernels`` flag: step time, MFU, peak memory; the first row also
    carries the logprob gap to HF transformers with the same weights."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, parallel = [], None
    with tempfile.TemporaryDirectory() as tmp:
        _write_config(Path(tmp), shape)
        batch = _batch(shape, device)
        for i, fused in enumerate(fused_flags):
            _reset_peak()
            engine = _engine(Path(tmp), batch, dtype, fused, parallel, GPU_MB_TOKENS.get(name))
            parallel = engine.parallel
            step_s = _time_steps(_train_step(engine, batch), steps)
            peak = _peak_gib()
            gap = _hf_gap(engine, batch, getattr(torch, dtype), device) if i == 0 else None
            rows.append(gpu_row(name, shape, fused, step_s, peak, gap) | _path_taken(engine))
            engine.destroy()
            del engine
    return rows


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
"""Set by ``--fused``: ``on`` or ``off`` runs only that GPU row of each shape."""
CLI_OPTIONS = {
    "--dtype": (DTYPES_ENV, DTYPE_CHOICES),
    "--shape": (SHAPE_ENV, {name: name for name in {**GPU_SHAPES_QUICK, **GPU_SHAPES}}),
    "--fused": (FUSED_ENV, {"on": "on", "off": "off"}),
}


def _gpu_shapes(quick: bool) -> dict[str, tuple]:
    """The GPU shapes to run: ``--shape``'s one, else the quick or the full set."""
    chosen = os.environ.get(SHAPE_ENV)
    if chosen:
        return {chosen: {**GPU_SHAPES_QUICK, **GPU_SHAPES}[chosen]}
    return GPU_SHAPES_QUICK if quick else GPU_SHAPES


def _fused_flags() -> tuple[bool, ...]:
    """The torch path first, then the kernels (a kernel fault must not cost the other row), or ``--fused``'s."""
    return {"on": (True,), "off": (False,)}.get(os.environ.get(FUSED_ENV, ""), (False, True))


def _run_gpu(quick: bool, on_rows=None) -> list[dict]:
    rows = []
    for name, shape in _gpu_shapes(quick).items():
        for fused in _fused_flags():
            rows.append(_row_in_own_process(name, shape, fused, 3 if quick else 5))
            if on_rows is not None:  # written now: a step budget that ends the next row keeps this one
                on_rows(rows)
    return rows


def _row_in_own_process(name: str, shape: tuple, fused: bool, steps: int) -> dict:
    """One GPU row in a fresh process (own CUDA context and process group); an error, the
    process's death included, becomes the row's ``error``."""
    ctx = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            return pool.submit(_gpu_rows_with_gap, name, shape, fused, steps).result()
    except Exception as exc:  # noqa: BLE001 (BrokenProcessPool included)
        return {
            "shape": name,
            "impl": "megatron",
            "fused_kernels": fused,
            "error": f"{type(exc).__name__}: {exc}"[:300],
        }


def _gpu_rows_with_gap(name: str, shape: tuple, fused: bool, steps: int) -> dict:
    return actor_rows(name, shape, "bfloat16", steps, fused_flags=(fused,))[0]


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
