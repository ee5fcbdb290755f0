"""Actor train step: tokens/s of MegatronEngine.train_batch, vs a plain HF step (CPU) or as MFU (GPU).

One process, one rank (``megatron:d1p1t1``), a random Qwen2-shaped model (QKV bias, GQA,
SwiGLU) whose size is set by the shape table below. A step is a packed micro-batch pass
of a token-mean next-token loss (fused vocab-parallel logprobs), backward, and an Adam
update. Timings: median over ``steps`` after one warm-up step.

* CPU (fp32): the same model as an HF transformers ``Qwen2ForCausalLM`` doing forward,
  log-softmax logprobs, backward and ``torch.optim.AdamW`` over the same tokens, in the
  same process; ``vs_hf`` = Megatron tokens/s over HF tokens/s.
* GPU (bf16, Megatron's mixed-precision distributed optimizer): a Qwen2.5-1.5B-shaped model;
  MFU = model FLOPs per second over the dense bf16 peak (989 TFLOP/s for H100/H200 SXM),
  with 6 N FLOPs per token for the N non-embedding + LM-head parameters plus causal
  attention 6 L S h (forward 2 + backward 4, halved for causality, times 2 matmuls).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._harness import main_for

TITLE = "Actor train step: Megatron train_batch tokens/s vs HF forward+backward (CPU); MFU (GPU)"

# name: (hidden, layers, heads, kv_heads, intermediate, vocab, sequences, seq_len)
CPU_SHAPES_QUICK = {"tiny": (128, 2, 4, 2, 256, 4096, 4, 128)}
CPU_SHAPES = {"small": (512, 4, 8, 4, 1408, 32000, 8, 512)}
GPU_SHAPES_QUICK = {"qwen2.5-1.5b-4L": (1536, 4, 12, 2, 8960, 151936, 16, 2048)}
GPU_SHAPES = {"qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, 16, 2048)}
PEAK_BF16_FLOPS = 989e12


def _write_config(out: Path, shape: tuple) -> None:
    from transformers import AutoConfig

    hidden, layers, heads, kv, inter, vocab, _, seq_len = shape
    config = AutoConfig.for_model(
        "qwen2", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=inter, vocab_size=vocab, max_position_embeddings=max(4096, seq_len), tie_word_embeddings=False,
    )  # fmt: skip
    config.save_pretrained(out)


def _batch(shape: tuple, device: str) -> dict:
    vocab, n, seq_len = shape[5], shape[6], shape[7]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, seq_len), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones(n, seq_len, dtype=torch.bool)}


def _nll(head, mb: dict) -> torch.Tensor:
    mask = mb["label_mask"]
    return -(head.logprobs(mb["labels"]) * mask).sum() / mask.sum().clamp(min=1)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_steps(step, steps: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(steps):
        _sync()
        start = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _megatron_step_time(model_dir: Path, batch: dict, dtype: str, steps: int) -> float:
    from megarl.actor.engine import MegatronEngine
    from megarl.config.train import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from megarl.utils.network import find_free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    tokens = int(batch["attention_mask"].sum())
    cfg = TrainEngineConfig(
        path=str(model_dir), dtype=dtype, init_from_scratch=True, mb_spec=MicroBatchSpec(max_tokens_per_mb=tokens),
        optimizer=OptimizerConfig(lr=1e-5, use_distributed_optimizer=True),
    )  # fmt: skip
    engine = MegatronEngine(cfg)
    engine.create_process_group("d1p1t1")
    engine.initialize()
    weight = lambda mb: mb["label_mask"].sum()
    return _time_steps(lambda: engine.train_batch(batch, _nll, weight), steps)


def _hf_step_time(model_dir: Path, batch: dict, steps: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = batch["input_ids"]

    def step():
        logits = model(ids).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])
        (-logp.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _time_steps(step, steps)


def _flops_per_token(shape: tuple) -> float:
    hidden, layers, heads, kv, inter, vocab, _, seq_len = shape
    head_dim = hidden // heads
    attn = hidden * head_dim * (heads + 2 * kv) + heads * head_dim * hidden
    params = layers * (attn + 3 * hidden * inter) + vocab * hidden  # + LM head
    return 6 * params + 6 * layers * seq_len * hidden


def _row(name: str, shape: tuple, impl: str, step_s: float, **extra) -> dict:
    tokens = shape[6] * shape[7]
    return {"shape": name, "impl": impl, "tokens/step": tokens, "step_s": step_s, "tokens/s": tokens / step_s, **extra}


def _run_cpu(quick: bool) -> list[dict]:
    rows = []
    for name, shape in (CPU_SHAPES_QUICK if quick else CPU_SHAPES).items():
        with tempfile.TemporaryDirectory() as tmp:
            _write_config(Path(tmp), shape)
            batch = _batch(shape, "cpu")
            steps = 2 if quick else 3
            hf = _hf_step_time(Path(tmp), batch, steps)
            mcore = _megatron_step_time(Path(tmp), batch, "float32", steps)
        rows.append(_row(name, shape, "megatron", mcore, vs_hf=hf / mcore))
        rows.append(_row(name, shape, "hf", hf))
    return rows


def _run_gpu(quick: bool) -> list[dict]:
    rows = []
    for name, shape in (GPU_SHAPES_QUICK if quick else GPU_SHAPES).items():
        with tempfile.TemporaryDirectory() as tmp:
            _write_config(Path(tmp), shape)
            step_s = _megatron_step_time(Path(tmp), _batch(shape, "cuda"), "bfloat16", 3 if quick else 5)
        tflops = _flops_per_token(shape) * shape[6] * shape[7] / step_s
        rows.append(_row(name, shape, "megatron", step_s, **{"TFLOP/s": tflops / 1e12, "MFU": tflops / PEAK_BF16_FLOPS}))
    return rows


def run(quick: bool) -> list[dict]:
    """CPU comparison with HF, or GPU MFU when CUDA is available."""
    return _run_gpu(quick) if torch.cuda.is_available() else _run_cpu(quick)


if __name__ == "__main__":
    main_for(__name__)
