"""How much of each optimizer step reaches the weights the model computes with, fp32 vs bf16.

One rank trains SmolLM2-135M-Instruct on a fixed policy-gradient batch (arithmetic prompts, a
right and a wrong answer each, advantages +1 / -1, token-mean ``-A * logp``) with the arithmetic
config's optimizer (Adam, lr 1e-5, clip 1.0) for ``STEPS`` steps, in three set-ups:

* ``fp32``: fp32 weights;
* ``bf16 nearest``: bf16 weights with fp32 main parameters, the bf16 copy refreshed by
  round-to-nearest (Megatron's mixed-precision optimizer as it comes);
* ``bf16 dithered``: the same with ``optimizer.bf16_rounding=dithered`` (megarl's default);
* both bf16 set-ups again with ``actor.emulate_bf16`` (bf16 weights and activations, matrix
  products in fp32), the emulation CPUs without native bf16 check bf16 learning with: it must
  reproduce the native rows.

Per step it records how far the policy moved on the batch (``moved``: the mean over answer tokens
of ``sign(A) * (logp_t - logp_0)``, in nats; positive is the direction the advantages ask for),
the fraction of weight elements that differ from the loaded checkpoint, and the mean absolute
weight change. The bf16 rows should move like the fp32 row; ``moved vs fp32`` says how much of
the fp32 movement each reaches.

    python -m benchmarks.bf16_update [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks._harness import main_for

TITLE = "bf16 weight updates: policy movement per step, fp32 vs bf16 (SmolLM2-135M, Adam lr 1e-5, one rank)"
ROOT = Path(__file__).resolve().parents[1]
STEPS, QUICK_STEPS = 8, 3
SETUPS = {
    "fp32": ("float32", "nearest", False),
    "bf16 nearest": ("bfloat16", "nearest", False),
    "bf16 dithered": ("bfloat16", "dithered", False),
    "bf16 nearest, emulated": ("bfloat16", "nearest", True),
    "bf16 dithered, emulated": ("bfloat16", "dithered", True),
}
"""Name -> (dtype, ``optimizer.bf16_rounding``, ``emulate_bf16``)."""
N_PROMPTS = 8


def policy_batch(model_dir: str, n_prompts: int = N_PROMPTS) -> dict:
    """Arithmetic chat prompts, each with its right answer (advantage +1) and a wrong one (-1)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in (ROOT / "megarl/data/arithmetic/train.jsonl").read_text().splitlines()]
    seqs, prompt_lens, advantages = [], [], []
    for row in rows[:n_prompts]:
        prompt = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        prompt_ids = tok(prompt)["input_ids"]
        for answer, adv in ((row["answer"], 1.0), (str(int(row["answer"]) + 1), -1.0)):
            seqs.append(prompt_ids + tok(answer + "<|im_end|>")["input_ids"])
            prompt_lens.append(len(prompt_ids))
            advantages.append(adv)
    width = max(map(len, seqs))
    batch = {
        key: torch.zeros(len(seqs), width, dtype=dt)
        for key, dt in (
            ("input_ids", torch.int64),
            ("attention_mask", torch.bool),
            ("loss_mask", torch.int32),
            ("advantages", torch.float32),
        )
    }
    for i, (seq, start, adv) in enumerate(zip(seqs, prompt_lens, advantages)):
        batch["input_ids"][i, : len(seq)] = torch.tensor(seq)
        batch["attention_mask"][i, : len(seq)] = True
        batch["loss_mask"][i, start : len(seq)] = 1
        batch["advantages"][i, : len(seq)] = adv
    return batch


def _answer_mask(mb: dict) -> torch.Tensor:
    """Positions whose next token is an answer token."""
    return torch.roll(mb["loss_mask"], -1, dims=0).bool() & mb["label_mask"]


def _pg_loss(head, mb: dict) -> torch.Tensor:
    mask = _answer_mask(mb)
    adv = torch.roll(mb["advantages"], -1, dims=0)
    return -(head.logprobs(mb["labels"]) * adv * mask).sum() / mask.sum()


def _signed_logp(engine, batch: dict) -> torch.Tensor:
    """``sign(A) * logp`` of every answer token ([N])."""
    mask = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    mask[:, :-1] = batch["loss_mask"][:, 1:].bool()
    logp = engine.eval().forward(batch)
    return (logp * batch["advantages"].sign())[mask]


def _weights(engine) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for chunk in engine.model for p in chunk.parameters()])


def worker(dtype: str, rounding: str, emulate: bool, steps: int, out: str) -> None:
    """One set-up in this process (one gloo rank): per-step movement and weight change, as JSON at ``out``."""
    from megarl.actor.engine import MegatronEngine
    from megarl.config.train import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from megarl.models.provision import resolve_model_path
    from megarl.utils.network import find_free_port

    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port())
    )
    torch.manual_seed(0)
    model_dir = str(resolve_model_path("smollm2-135m-instruct"))
    optimizer = OptimizerConfig(lr=1e-5, weight_decay=0.0, gradient_clipping=1.0, bf16_rounding=rounding)
    cfg = TrainEngineConfig(
        path=model_dir, dtype=dtype, mb_spec=MicroBatchSpec(4096), optimizer=optimizer, emulate_bf16=emulate
    )
    engine = MegatronEngine(cfg)
    engine.create_process_group("d1p1t1")
    engine.initialize()
    batch = policy_batch(model_dir)
    weight = lambda mb: _answer_mask(mb).sum()
    logp0, w0 = _signed_logp(engine, batch), _weights(engine)
    rows = []
    for step in range(1, steps + 1):
        stats = engine.train().train_batch(batch, _pg_loss, weight)
        w = _weights(engine)
        rows.append(
            {
                "step": step,
                "moved": float((_signed_logp(engine, batch) - logp0).mean()),
                "changed": float((w != w0).float().mean()),
                "mean abs dw": float((w - w0).abs().mean()),
                "grad_norm": stats["grad_norm"],
            }
        )
    Path(out).write_text(json.dumps(rows))


def _run_setup(dtype: str, rounding: str, emulate: bool, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="megarl_bf16_") as tmp:
        out = Path(tmp) / "rows.json"
        code = f"from benchmarks.bf16_update import worker; worker({dtype!r}, {rounding!r}, {emulate}, {steps}, {str(out)!r})"
        env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1), HF_HUB_OFFLINE="1")
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{dtype}/{rounding}/emulate={emulate} failed:\n{result.stderr[-4000:]}")
        return json.loads(out.read_text())


def run(quick: bool) -> list[dict]:
    steps = QUICK_STEPS if quick else STEPS
    results = {name: _run_setup(*setup, steps) for name, setup in SETUPS.items()}
    rows = []
    for name, per_step in results.items():
        for row, ref in zip(per_step, results["fp32"]):
            rows.append({"setup": name, **row, "moved vs fp32": row["moved"] / ref["moved"] if ref["moved"] else None})
    return rows


if __name__ == "__main__":
    main_for(__name__)
