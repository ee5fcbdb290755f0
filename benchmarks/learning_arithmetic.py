"""GRPO learning, measured in both dtypes: ``configs/arithmetic_grpo_cpu.yaml`` end to end (the real stack).

The runs that ``tests/train/test_learning.py`` asserts on, kept as a table: for each dtype
(fp32, and bf16 as GPUs train) and each of two seeds, 15 steps; per run the batch reward of
every step, the mean of the first 5 and of the last 5 steps and their gain (the bar: +0.3),
the median step time and the wall time. The bf16 runs are native where the CPU computes bf16
(AVX-512 BF16 / AMX) and emulated elsewhere (:func:`dtype_overrides`); ``bf16, nearest`` is the
bf16 run with Megatron's round-to-nearest weight copy (``actor.optimizer.bf16_rounding=nearest``),
which learns a fraction of what fp32 learns. The curves go to ``learning_arithmetic.png`` (on a CPU
without native bf16: ``learning_arithmetic_emulated.*``, see :func:`results_name`).
``--quick`` runs 6 steps of one seed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import RESULTS_DIR, main_for

TITLE = "GRPO learning check, fp32 and bf16: arithmetic, SmolLM2-135M-Instruct, CPU (configs/arithmetic_grpo_cpu.yaml)"
ROOT = Path(__file__).resolve().parents[1]
STEPS, QUICK_STEPS = 15, 6
SEEDS = (1, 2)
GAIN_BAR = 0.3
"""Mean reward of the last 5 steps minus that of the first 5, within :data:`STEPS` steps."""
SETUPS = {
    "fp32": ("float32", []),
    "bf16": ("bfloat16", []),
    "bf16, nearest": ("bfloat16", ["actor.optimizer.bf16_rounding=nearest"]),
}
"""Name -> (dtype, extra overrides)."""


def dtype_overrides(dtype: str) -> list[str]:
    """Overrides that train and serve in ``dtype`` on this machine.

    bf16 on a CPU without native bf16 (AVX2 only, where a bf16 matrix product is over 100x slower)
    is emulated: the trainer keeps bf16 weights and activations and computes each matrix product
    in fp32 (``actor.emulate_bf16``), the server holds the same bf16 values in fp32.
    """
    from megarl.utils.hardware import cpu_bf16_native

    if dtype == "float32":
        return ["actor.dtype=float32", "vllm.dtype=float32"]
    if cpu_bf16_native()[0]:
        return ["actor.dtype=bfloat16", "vllm.dtype=bfloat16"]
    return ["actor.dtype=bfloat16", "actor.emulate_bf16=true", "vllm.dtype=float32"]


def run_arithmetic(
    overrides: list[str], files: tuple[str, ...] | list[str] = (), fileroot: str | None = None
) -> tuple[list[dict], float]:
    """``megarl run configs/arithmetic_grpo_cpu.yaml *files *overrides``: its metrics per step and wall minutes.
    The run's directory is under ``fileroot`` (kept), else under a temporary directory (removed)."""
    with tempfile.TemporaryDirectory(prefix="megarl_learning_") as tmp:
        tmp = fileroot or tmp
        cmd = [
            sys.executable,
            "-m",
            "megarl.launcher.cli",
            "run",
            str(ROOT / "configs" / "arithmetic_grpo_cpu.yaml"),
            *files,
            f"cluster.fileroot={tmp}",
            "stats_logger.wandb.mode=disabled",
            *overrides,
        ]
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
        start = time.monotonic()
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        minutes = (time.monotonic() - start) / 60
        if result.returncode != 0:
            raise RuntimeError(f"megarl run {' '.join(overrides)} failed:\n{(result.stdout + result.stderr)[-4000:]}")
        run_dir = Path(tmp) / "arithmetic-grpo-cpu" / "trial0"
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, minutes


def results_name() -> str:
    """``learning_arithmetic`` on a CPU with native bf16, ``learning_arithmetic_emulated`` where bf16 is
    emulated: the two tables are kept side by side."""
    from megarl.utils.hardware import cpu_bf16_native

    return "learning_arithmetic" if cpu_bf16_native()[0] else "learning_arithmetic_emulated"


def run(quick: bool) -> list[dict]:
    rows, curves = [], {}
    for name, (dtype, extra) in SETUPS.items():
        for seed in SEEDS[:1] if quick else SEEDS:
            overrides = [
                *dtype_overrides(dtype),
                *extra,
                f"seed={seed}",
                f"total_train_steps={QUICK_STEPS if quick else STEPS}",
            ]
            metrics, minutes = run_arithmetic(overrides)
            rewards = [m["batch/reward/avg"] for m in metrics]
            curves[f"{name}, seed {seed}"] = rewards
            first, last = reward_gain(rewards)
            rows.append(
                {
                    "setup": name,
                    "overrides": " ".join(overrides[:-2]),
                    "seed": seed,
                    "reward per step": " ".join(f"{r:.2f}" for r in rewards),
                    "first 5": first,
                    "last 5": last,
                    "gain": last - first,
                    "step s (median)": statistics.median(m["timeperf/step"] for m in metrics),
                    "wall min": minutes,
                }
            )
    if not quick:
        _plot(curves, RESULTS_DIR / f"{results_name()}.png")
    return rows


def _plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rewards in curves.items():
        ax.plot(
            range(1, len(rewards) + 1),
            rewards,
            marker="o",
            ms=3,
            label=label,
            linestyle="--" if "nearest" in label else "-",
        )
    ax.set(xlabel="step", ylabel="batch reward", title="GRPO on arithmetic, SmolLM2-135M, CPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def reward_gain(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first 5 steps and of the last 5 (the learning bar compares them)."""
    return statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])


def summary(rows: list[dict]) -> str:
    """The mean gain of each setup over its seeds, against the bar."""
    parts = []
    for name in dict.fromkeys(row["setup"] for row in rows):
        gains = [row["gain"] for row in rows if row["setup"] == name]
        parts.append(f"{name}: gain {' / '.join(f'{g:+.2f}' for g in gains)} (mean {statistics.fmean(gains):+.2f})")
    return "; ".join(parts) + f" (bar: +{GAIN_BAR} within {STEPS} steps, first 5 vs last 5 steps)"


if __name__ == "__main__":
    main_for(__name__)
