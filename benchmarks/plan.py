"""``megarl plan`` predictions against measured CPU steps.

Every run is ``megarl run configs/gsm8k_grpo_cpu.yaml`` (one vLLM-CPU server and a one-rank gloo
Megatron trainer on SmolLM2-135M, 2 cores) with every sample generating exactly
``gconfig.max_new_tokens`` tokens (``gconfig.min_new_tokens`` equal to it) and every step
training on its whole batch, so that the step's tokens do not depend on sampling, and the same
seed, so that every run sees the same prompts.

``--calibrate`` measures the component rates. One synchronous run (``rollout.max_staleness=0``:
the phases take turns, so each phase's timer times that component alone) per thread policy,

* ``static``: the server on one core, the trainer on the other;
* ``shared``: each takes both cores in its turn;

gives server tokens/s = generated tokens / rollout seconds, trainer tokens/s = trained tokens /
(recompute + update seconds), sync and overhead seconds as measured. One asynchronous ``static``
run (``max_staleness=1``) then gives ``overlap_slowdown``: how much slower the two run while they
share the machine's two cores (on separate GPUs this is 1). It writes
``benchmarks/results/plan_rates_cpu_{static,shared}.yaml`` (rates files for ``megarl plan
--rates``); the first steps of a run are warm-up and not counted.

Without ``--calibrate`` it predicts each layout of ``LAYOUTS`` from those files
(:func:`megarl.plan.predict`) and measures it ``REPEATS`` times in fresh runs, none of them a
calibration run. The first layout was calibrated (in other runs): it checks the model's sums and
the run-to-run noise. The others, with twice the batch (synchronous on either thread policy, and
``static`` asynchronous), were not: they test the model on workloads the rates never saw. ``pred step s, f=1`` is the prediction without
the measured contention (what the model predicts from synchronous runs alone). A virtual
machine's speed drifts: numbers move from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from benchmarks._harness import RESULTS_DIR, print_record, run_benchmark
from megarl.config import AllocationMode
from megarl.plan import Rates, ServerRate, Workload, load_rates, predict, rates_to_dict
from megarl.run.prelaunch import MODEL_SHORT_NAMES

TITLE = "megarl plan: predicted vs measured RL step on CPU (SmolLM2-135M, vLLM-CPU + 1-rank gloo trainer, 2 cores)"
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "gsm8k_grpo_cpu.yaml"
ALLOCATION = "vllm:d1t1+megatron:d1p1t1"
POLICIES = ("static", "shared")
LAYOUTS = [("static", 0, 2), ("static", 0, 4), ("shared", 0, 4), ("static", 1, 4)]
"""(cluster.cpu_threads, rollout.max_staleness, train_dataset.batch_size) of each validated layout."""
REPEATS = 2
STEPS, WARMUP = 5, 2
SAMPLES, MAX_NEW_TOKENS = 4, 128
"""gconfig.n_samples and gconfig.max_new_tokens of the config."""


def rates_path(policy: str) -> Path:
    return RESULTS_DIR / f"plan_rates_cpu_{policy}.yaml"


def measure(policy: str, staleness: int, root: Path, trial: str, batch_size: int = 2, steps: int = STEPS) -> list[dict]:
    """The per-step metrics of one fresh run after its warm-up steps."""
    overrides = [
        f"cluster.fileroot={root}",
        f"trial_name={trial}",
        f"cluster.cpu_threads={policy}",
        f"rollout.max_staleness={staleness}",
        f"total_train_steps={steps}",
        "valid_dataset=null",
        "saver.freq_steps=null",
        "stats_logger.wandb.mode=disabled",
        "stats_logger.tensorboard.enabled=false",
        "actor.skip_zero_advantage=false",
        "gconfig.min_new_tokens=${gconfig.max_new_tokens}",
        f"train_dataset.batch_size={batch_size}",
    ]
    metrics = root / "gsm8k-grpo-cpu" / trial / "metrics.jsonl"
    if metrics.is_file() and len(metrics.read_text().splitlines()) == steps:
        return [json.loads(line) for line in metrics.read_text().splitlines()][WARMUP:]  # done by an earlier call
    cmd = [sys.executable, "-m", "megarl.launcher.cli", "run", str(CONFIG), *overrides]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    for attempt in range(2):  # on a shared machine a run may be killed for memory: run it again once
        shutil.rmtree(metrics.parent, ignore_errors=True)
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if result.returncode == 0:
            return [json.loads(line) for line in metrics.read_text().splitlines()][WARMUP:]
        sys.stderr.write(
            f"megarl run ({trial}) failed (attempt {attempt + 1}):\n{(result.stdout + result.stderr)[-1500:]}\n"
        )
    raise RuntimeError(f"megarl run ({trial}) failed twice:\n{(result.stdout + result.stderr)[-4000:]}")


def _sum(steps: list[dict], key: str) -> float:
    return sum(m.get(key, 0.0) for m in steps)


def calibrate(steps: list[dict], policy: str, when: str) -> Rates:
    """Rates of one synchronous run: each phase timed alone."""
    seqs = _sum(steps, "batch/n_seqs")
    generated = _sum(steps, "ppo_actor/n_tokens")  # loss tokens: all generated ones (no sequence skipped)
    trained = sum(m["batch/n_seqs"] * m["batch/seq_len/avg"] for m in steps)
    train_s = _sum(steps, "timeperf/recompute_logp") + _sum(steps, "timeperf/train_step")
    phases = ("timeperf/rollout", "timeperf/recompute_logp", "timeperf/train_step", "timeperf/update_weights")
    overhead = _sum(steps, "timeperf/step") - sum(_sum(steps, k) for k in phases)
    n = len(steps)
    source = (
        f"measured: benchmarks/plan.py --calibrate, cluster.cpu_threads={policy}, rollout.max_staleness=0, "
        f"{n} steps of configs/gsm8k_grpo_cpu.yaml, {when}"
    )
    workload = Workload(
        prompts=round(seqs / n / SAMPLES),
        samples=SAMPLES,
        prompt_tokens=(trained - generated) / seqs,
        gen_tokens=generated / seqs,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    return Rates(
        source=source,
        server={1: ServerRate(generated / _sum(steps, "timeperf/rollout"))},
        trainer={(1, 1): trained / train_s},
        sync_fixed_s=_sum(steps, "timeperf/update_weights") / n,
        overhead_s=overhead / n,
        workload=workload,
        model=MODEL_SHORT_NAMES["smollm2-135m-instruct"],
    )


def overlap_slowdown(rates: Rates, steps: list[dict]) -> float:
    """``overlap_slowdown`` from an asynchronous run whose rollout is shorter than its training:
    the training's excess over its isolated time, spread over the overlapped (rollout) seconds."""
    generated = _sum(steps, "ppo_actor/n_tokens")
    trained = sum(m["batch/n_seqs"] * m["batch/seq_len/avg"] for m in steps)
    excess = (
        _sum(steps, "timeperf/recompute_logp") + _sum(steps, "timeperf/train_step") - trained / rates.trainer[(1, 1)]
    )
    return max(1.0, 1 + excess / (generated / rates.server[1].tokens_per_s))


def run_calibration() -> None:
    import dataclasses
    import datetime

    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")
    with tempfile.TemporaryDirectory(prefix="megarl_plan_") as tmp:
        for policy in POLICIES:
            rates = calibrate(measure(policy, 0, Path(tmp), f"calibrate-{policy}"), policy, when)
            if policy == "static":
                f = overlap_slowdown(rates, measure(policy, 1, Path(tmp), "calibrate-static-async"))
                rates = dataclasses.replace(
                    rates, overlap_slowdown=f, source=rates.source + "; overlap_slowdown from one max_staleness=1 run"
                )
            rates_path(policy).write_text(yaml.safe_dump(rates_to_dict(rates), sort_keys=False))
            sys.stdout.write(f"wrote {rates_path(policy)}\n")


def _row(policy: str, staleness: int, batch_size: int, rates: Rates, runs: list[list[dict]]) -> dict:
    import dataclasses

    work, alloc = dataclasses.replace(rates.workload, prompts=batch_size), AllocationMode.from_str(ALLOCATION)
    pred = predict(rates, work, alloc, staleness)
    no_contention = predict(dataclasses.replace(rates, overlap_slowdown=1.0), work, alloc, staleness)
    step_means = [statistics.fmean(m["timeperf/step"] for m in run) for run in runs]
    median = statistics.median(step_means)
    all_steps = [m for run in runs for m in run]
    calibrated = batch_size == rates.workload.prompts and (staleness == 0 or rates.overlap_slowdown != 1.0)
    return {
        "cpu_threads": policy,
        "max_staleness": staleness,
        "batch_size": batch_size,
        "layout calibrated": "yes (other runs)" if calibrated else "no",
        "runs x steps": f"{len(runs)} x {len(runs[0])}",
        "pred rollout s": pred.rollout_s,
        "pred train s": pred.train_s,
        "pred sync s": pred.sync_s,
        "pred step s": pred.step_s,
        "pred step s, f=1": no_contention.step_s,
        "pred overlap %": pred.overlap_pct,
        "measured step s (min)": min(step_means),
        "measured step s (median)": median,
        "error %": 100 * (pred.step_s - median) / median,
        "within 20%": abs(pred.step_s - median) <= 0.2 * median,
        "error % f=1": 100 * (no_contention.step_s - median) / median,
        "measured rollout wait s": statistics.fmean(m["timeperf/rollout"] for m in all_steps),
        "measured train s": statistics.fmean(
            m.get("timeperf/recompute_logp", 0.0) + m["timeperf/train_step"] for m in all_steps
        ),
        "measured sync s": statistics.fmean(m["timeperf/update_weights"] for m in all_steps),
        "measured tokens/step": statistics.fmean(m["batch/n_seqs"] * m["batch/seq_len/avg"] for m in all_steps),
        "pred tokens/step": work.trained,
    }


def run(quick: bool) -> list[dict]:
    missing = [str(rates_path(p)) for p in POLICIES if not rates_path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"no calibration: {', '.join(missing)}; run python -m benchmarks.plan --calibrate")
    write_gpu_plan()
    layouts, repeats = (LAYOUTS[:1], 1) if quick else (LAYOUTS, REPEATS)
    rows = []
    # runs are kept there until the table is written: a call after a failure resumes
    root = Path(tempfile.gettempdir()) / "megarl_plan_runs"
    for policy, staleness, batch in layouts:
        runs = [measure(policy, staleness, root, f"{policy}-s{staleness}-b{batch}-{i}", batch) for i in range(repeats)]
        rows.append(_row(policy, staleness, batch, load_rates(rates_path(policy)), runs))
    shutil.rmtree(root, ignore_errors=True)
    return rows


GPU_CONFIG = "configs/gsm8k_grpo_qwen2.5-7b_128gpu.yaml"
GPU_RATES = "benchmarks/plan_rates_h100_qwen2.5-7b.yaml"


def write_gpu_plan() -> Path:
    """``megarl plan`` on the 128-GPU config with the ASSUMED H100 rates, into ``plan_128gpu.md``:
    the ranking, where the config's own split stands in it, and that split's prediction."""
    bundled = yaml.safe_load((ROOT / GPU_CONFIG).read_text())["allocation_mode"]
    cmd = [sys.executable, "-m", "megarl.launcher.cli", "plan", "--rates", GPU_RATES, "--config", GPU_CONFIG]
    ranking = subprocess.run(cmd + ["--top", "1000"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = [line.split("|") for line in ranking.splitlines() if re.match(r"^\| \d+ \|", line)]
    rank = next(int(r[1]) for r in rows if r[2].strip() == bundled)
    first_s, bundled_s = float(rows[0][6]), float(rows[rank - 1][6])
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    mine = subprocess.run(cmd + ["--mode", bundled], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    path = RESULTS_DIR / "plan_128gpu.md"
    path.write_text(
        f"# megarl plan: {GPU_CONFIG} on 16 nodes x 8 GPUs (ASSUMED rates)\n\n"
        f"Every rate below is an assumption ({GPU_RATES} cites where each comes from), not a measurement: "
        f"megarl has not trained on a GPU cluster (one H200 ran its kernels, a 4-layer actor step and the full 28-layer Qwen2.5-1.5B actor step). The bundled config's split, `{bundled}`, ranks {rank} of {len(rows)} "
        f"({bundled_s:.1f} s a step; the first: {first_s:.1f} s); its prediction is at the end.\n\n"
        f"```\n$ megarl {' '.join(cmd[3:])}\n{out}```\n\n```\n$ megarl {' '.join(cmd[3:])} --mode {bundled}\n{mine}```\n"
    )
    return path


def summary(rows: list[dict]) -> str:
    hits = sum(bool(r["within 20%"]) for r in rows)
    load = os.getloadavg()[0]
    return (
        f"{hits} of {len(rows)} layouts predicted within 20% of the median measured step time. "
        f"Rates: benchmarks/results/plan_rates_cpu_{{static,shared}}.yaml (`--calibrate`). Load average {load:.2f} "
        "at the end, the last run's own server and trainer included (the load at the start is in the record's "
        "machine line): each layout ran in fresh runs, min and median of the runs' mean step times shown."
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="megarl plan vs measured CPU steps")
    parser.add_argument("--calibrate", action="store_true", help="measure the rates files first (two short runs)")
    parser.add_argument("--quick", action="store_true", help="one layout, one run")
    args = parser.parse_args()
    if args.calibrate:
        run_calibration()
    else:
        print_record(run_benchmark("plan", quick=args.quick))
