"""The main job as ``make run`` runs it: ``megarl run configs/gsm8k_grpo_cpu.yaml`` with its defaults.

One run (8 steps of GRPO on GSM8K with SmolLM2-135M-Instruct: a vLLM-CPU server and a one-rank
gloo Megatron trainer, ``dtype: auto``) in a fresh ``cluster.fileroot`` under the temporary
directory. A row per step, from the run's ``metrics.jsonl``: the step's time and where it went
(rollout wait, logprob recompute, PPO update, weight sync), the reward of the trained batch, the
train-inference logprob gap and the trainer's peak RSS. Then one row for the run: its wall
time (the command, start-up and the final evaluation and checkpoint included, the venv already
built), the dtype the launcher chose, pass@1 before training and at the last step (greedy, on
``evaluator.max_samples`` test prompts), the trainer's peak RSS, the whole run's (the launcher, the
vLLM server, the trainer and the reward workers together, sampled every 0.5 s) and the size of the
venv it ran from. These are the figures the README, home page and quickstart quote.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import main_for
from benchmarks.peer_trl import TreeRSS

TITLE = "The main job (make run: megarl run configs/gsm8k_grpo_cpu.yaml, defaults): per step and the run"
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "gsm8k_grpo_cpu.yaml"
TIMES = {
    "step s": "timeperf/step",
    "rollout s": "timeperf/rollout",
    "recompute s": "timeperf/recompute_logp",
    "update s": "timeperf/train_step",
    "sync s": "timeperf/update_weights",
}
GAP = "ppo_actor/gap/lag_0/abs_logp_diff/avg"


def _peak_gb(metrics: dict) -> float | None:
    peaks = [v for k, v in metrics.items() if k.startswith("memory/") and k.endswith("_peak_gb")]
    return max(peaks) if peaks else None


def step_row(metrics: dict, index: int) -> dict:
    row = {"kind": "step", "step": index + 1}
    for label, key in TIMES.items():
        row[label] = metrics.get(key, 0.0)
    row["reward"] = metrics.get("batch/reward/avg")
    row["gap nats"] = metrics.get(GAP)
    row["peak RSS GB"] = _peak_gb(metrics)
    return row


def venv_gb() -> float:
    """Disk used by the environment megarl runs from (``sys.prefix``: ``.venv`` under ``make``)."""
    out = subprocess.run(["du", "-sk", sys.prefix], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) / 1024**2


def run(quick: bool) -> list[dict]:
    overrides = ["total_train_steps=2", "saver.freq_steps=2", "evaluator.freq_steps=2"] if quick else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    with tempfile.TemporaryDirectory(prefix="megarl_main_job_") as tmp:
        cmd = [sys.executable, "-m", "megarl.launcher.cli", "run", str(CONFIG), f"cluster.fileroot={tmp}", *overrides]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with TreeRSS(proc.pid) as tree:  # the launcher, the vLLM server, the trainer and the reward workers
            stdout, stderr = proc.communicate()
        wall = time.perf_counter() - start
        console = stdout + stderr
        if proc.returncode != 0:
            raise RuntimeError(f"megarl run failed ({proc.returncode}):\n{console[-4000:]}")
        lines = (Path(tmp) / "gsm8k-grpo-cpu" / "trial0" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if line.strip()]
    rows = [step_row(m, i) for i, m in enumerate(steps)]
    before = re.search(r"before training: pass@1 ([0-9.]+) on (\d+) prompts", console)
    dtype = re.search(r"dtype: trainer (\w+)", console)
    evaluated = [m for m in steps if "eval/pass@1" in m]
    peaks = [r["peak RSS GB"] for r in rows if r["peak RSS GB"] is not None]
    rows.append(
        {
            "kind": "run",
            "steps": len(steps),
            "wall s": wall,
            "wall min": wall / 60,
            "dtype": dtype.group(1) if dtype else None,
            "pass@1 before": float(before.group(1)) if before else None,
            "pass@1 last": evaluated[-1]["eval/pass@1"] if evaluated else None,
            "eval prompts": int(before.group(2)) if before else None,
            "peak RSS GB": max(peaks) if peaks else None,
            "whole run peak RSS GB": tree.peak_gb,
            "venv GB": venv_gb(),
        }
    )
    return rows


if __name__ == "__main__":
    main_for(__name__)
