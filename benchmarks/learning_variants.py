"""Learning of the loss variants side by side: GRPO and its rollout corrections on arithmetic (CPU).

Each variant is ``configs/arithmetic_grpo_cpu.yaml`` (25 steps, SmolLM2-135M-Instruct, one
vLLM-CPU server, synchronous) with a few keys changed, run end to end like
``benchmarks/learning_arithmetic.py``. The table has one reward column per variant (the batch
mean per step); the summary gives each one's gain (last 5 steps vs first 5; the bar is +0.15
within the GRPO budget of 25 steps), its wall time, and what its correction did: the mean
|train - inference| logprob gap and the fractions of tokens truncated or masked.
``--quick`` runs 6 steps of each; ``MEGARL_VARIANTS=ppo_critic,grpo`` runs only those (results
then go to ``learning_variants_<names>.{json,md}``).
"""

from __future__ import annotations

import os

from benchmarks._harness import main_for
from benchmarks.learning_arithmetic import reward_gain, run_arithmetic

TITLE = "Loss variants learning arithmetic side by side (SmolLM2-135M-Instruct, CPU, configs/arithmetic_grpo_cpu.yaml)"
_CORRECTION = ["actor.behav_imp_weight_cap=null"]
VARIANTS: dict[str, list[str]] = {
    "grpo": [],
    "tis_token": [*_CORRECTION, "actor.rollout_correction.mode=truncate", "actor.rollout_correction.upper=2.0"],
    "mis_sequence": [
        *_CORRECTION,
        "actor.rollout_correction.mode=mask",
        "actor.rollout_correction.level=sequence",
        "actor.rollout_correction.upper=2.0",
    ],
    "icepop_token": [
        *_CORRECTION,
        "actor.rollout_correction.mode=two_sided_mask",
        "actor.rollout_correction.upper=2.0",
        "actor.rollout_correction.lower=0.5",
    ],
    # a fresh (zero) value head barely moves at the default critic lr 1e-5 in 25 steps (mean value 0.04 against
    # returns 0.55 after 8 steps); at 1e-4 the mean value meets the mean return by step 7. A step trains two
    # models and skips no uniform group (GAE advantages are not 0 there): ~55 s against GRPO's ~20 s on 2 AVX2
    # cores, so 15 steps keep the run within the 20-minute budget.
    "ppo_critic": ["algorithm.adv_estimator=gae", "critic={}", "critic.optimizer.lr=1e-4", "total_train_steps=15"],
}
"""Variant name -> overrides of the arithmetic config."""
_STATS = {
    "|dlogp|": "ppo_actor/rollout_correction/abs_logp_diff/avg",
    "truncated": "ppo_actor/rollout_correction/truncated/avg",
    "masked": "ppo_actor/capped_ratio/avg",
    "value error": "ppo_critic/abs_error/avg",
    "mean value": "ppo_critic/values/avg",
    "mean return": "ppo_critic/returns/avg",
}
_summaries: list[str] = []


def selected() -> dict[str, list[str]]:
    """The variants ``$MEGARL_VARIANTS`` names (comma-separated), else all."""
    names = [n for n in os.environ.get("MEGARL_VARIANTS", "").split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"MEGARL_VARIANTS: unknown {unknown}; choose from {sorted(VARIANTS)}")
    return {n: VARIANTS[n] for n in names} if names else dict(VARIANTS)


def results_name() -> str:
    chosen = selected()
    return "learning_variants" if len(chosen) == len(VARIANTS) else "learning_variants_" + "_".join(chosen)


def run(quick: bool) -> list[dict]:
    _summaries.clear()
    rewards: dict[str, list[float]] = {}
    for name, overrides in selected().items():
        metrics, minutes = run_arithmetic([*overrides, *(["total_train_steps=6"] if quick else [])])
        rewards[name] = [m["batch/reward/avg"] for m in metrics]
        first, last = reward_gain(rewards[name])
        # what a variant does not log (a critic's values without a critic) is left out, not written as nan
        stats = ", ".join(
            f"{label} {_mean(metrics, key):.3g}" for label, key in _STATS.items() if any(key in m for m in metrics)
        )
        if any(_STATS["value error"] in m for m in metrics):
            stats += f"; value error of the last 5 steps {_mean(metrics[-5:], _STATS['value error']):.3g}"
        _summaries.append(
            f"{name}: first 5 {first:.3f}, last 5 {last:.3f}, gain {last - first:+.3f} over "
            f"{len(metrics)} steps in {minutes:.1f} min; {stats}"
        )
    steps = max(len(r) for r in rewards.values())
    return [{"step": i, **{name: r[i] if i < len(r) else None for name, r in rewards.items()}} for i in range(steps)]


def _mean(metrics: list[dict], key: str) -> float:
    values = [m[key] for m in metrics if key in m]
    return sum(values) / len(values) if values else float("nan")


def summary(rows: list[dict]) -> str:
    from megarl.utils.hardware import auto_dtype

    dtype = auto_dtype("cpu")[0]  # no variant sets a dtype: the runs used the config's `auto`
    return f"dtype {dtype} (`dtype: auto` on this CPU)\n" + "\n".join(f"- {line}" for line in _summaries)


if __name__ == "__main__":
    main_for(__name__)
