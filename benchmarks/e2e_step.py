"""End-to-end RL step time on CPU with the real stack: asynchronous (staleness 2) vs synchronous (0).

Each mode is one ``megarl run`` of ``configs/gsm8k_grpo_cpu.yaml`` (a vLLM-CPU server and a
one-rank gloo Megatron trainer on SmolLM2-135M); the trainer's per-step timings
(``timeperf/*`` in ``metrics.jsonl``) give the breakdown: rollout wait, logprob
recompute, PPO update, weight sync. The first steps are warm-up and not counted.
Asynchronous rollout lets the server generate the next batch while the trainer
updates, so the rollout wait shrinks; on a 2-core machine server and trainer also
compete for the same cores, which bounds the gain.
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

TITLE = "RL step time breakdown on CPU (SmolLM2-135M, vLLM-CPU + 1-rank gloo trainer): async vs sync"
ROOT = Path(__file__).resolve().parents[1]
PARTS = {"rollout wait": "timeperf/rollout", "recompute logp": "timeperf/recompute_logp",
         "ppo update": "timeperf/train_step", "weight sync": "timeperf/update_weights", "step": "timeperf/step"}  # fmt: skip


def _run_mode(staleness: int, steps: int, warmup: int, root: Path) -> dict:
    overrides = [
        f"cluster.fileroot={root}", f"trial_name=staleness{staleness}", f"rollout.max_staleness={staleness}",
        f"total_train_steps={steps}", "valid_dataset=null", "saver.freq_steps=null",
        "stats_logger.wandb.mode=disabled", "stats_logger.tensorboard.enabled=false", "gconfig.max_new_tokens=128",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "megarl.launcher.cli", "run", str(ROOT / "configs" / "gsm8k_grpo_cpu.yaml"), *overrides]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"megarl run (staleness {staleness}) failed:\n{(result.stdout + result.stderr)[-4000:]}")
    lines = (root / "gsm8k-grpo-cpu" / f"staleness{staleness}" / "metrics.jsonl").read_text().splitlines()
    measured = [json.loads(line) for line in lines][warmup:]
    row = {"mode": "async" if staleness else "sync", "max_staleness": staleness, "steps": len(measured)}
    for label, key in PARTS.items():
        row[f"{label} s"] = statistics.fmean(m.get(key, 0.0) for m in measured)
    row["mean staleness"] = statistics.fmean(m.get("rollout/staleness/avg", 0.0) for m in measured)
    return row


def run(quick: bool) -> list[dict]:
    steps, warmup = (4, 1) if quick else (8, 2)
    with tempfile.TemporaryDirectory(prefix="megarl_e2e_") as tmp:
        rows = [_run_mode(s, steps, warmup, Path(tmp)) for s in (0, 2)]
    sync_step = rows[0]["step s"]
    for row in rows:
        row["speedup vs sync"] = sync_step / row["step s"]
    return rows


if __name__ == "__main__":
    main_for(__name__)
