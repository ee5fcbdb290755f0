"""What the trainer prints on the console: the start-up lines, the rollout's status beside the
run's bar, a line per step, warnings, and the summary at the end.

The trainer script (``megarl.train``) holds the run's logic and takes its text from here; where
the lines go (the terminal, ``logs/trainer.log``, the bar) is ``megarl.utils.console``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from megarl.actor.gap import gap_warning
from megarl.config import GRPOConfig
from megarl.config.bridge import WeightUpdateConfig
from megarl.kernels import Backend, kernel_summary
from megarl.reward.failures import reward_failures_note
from megarl.utils.console import Console, Progress

logger = logging.getLogger("megarl.train")

STEP_TIMINGS = (
    ("rollout", "rollout"),
    ("logp", "recompute_logp"),
    ("values", "critic_values"),
    ("train", "train_step"),
    ("critic", "critic_train"),
    ("sync", "update_weights"),
)
"""(label on the step's line, ``timeperf/`` key) of the phases whose seconds the step's line shows."""


def kernel_line(backend: Backend) -> str | None:
    """The console's start-up line on the fused kernels where a GPU runs them: the path their
    self-check chose, and any mainloop that failed it (``megarl.kernels.selfcheck``); None on a
    CPU or with the kernels off."""
    if backend == "torch" or not torch.cuda.is_available():
        return None
    return f"fused kernels: {kernel_summary(backend)}"


def start_lines(backend: Backend, skipped_rows: list[str]) -> list[str]:
    """The console's lines before the first step: the fused kernels' path (on a GPU) and the
    dataset rows skipped at load (``bad_rows: skip``)."""
    lines = [line] if (line := kernel_line(backend)) is not None else []
    if skipped_rows:
        lines.append(f"dataset: skipped {len(skipped_rows)} bad rows (bad_rows: skip); the first: {skipped_rows[0]}")
    return lines


def baseline_line(baseline: dict[str, float]) -> str:
    """The console's line on the evaluation before the first step (``evaluator.before_training``)."""
    return f"before training: pass@1 {baseline['eval/pass@1']:.3f} on {baseline['eval/n_samples']:.0f} prompts"


@contextlib.contextmanager
def rollout_bar(progress: Progress | None, total: int) -> Iterator[Callable[[int], None] | None]:
    """Accepted groups of the batch (``total``) this rank waits for, shown beside the run's bar;
    yields the update callback (None without a bar)."""
    if progress is None:
        yield None
        return
    progress.status(f"rollout 0/{total} groups")
    yield lambda n: progress.status(f"rollout {n}/{total} groups")
    progress.status("training")


def step_line(global_step: int, total_steps: int, stats: dict[str, float]) -> str:
    """The console's line for a step: reward, the distance to a teacher (on-policy distillation), evaluation,
    where the time went, the train phase's tokens/s per rank (and MFU on a GPU)."""
    timing = [(label, stats.get(f"timeperf/{key}")) for label, key in STEP_TIMINGS]
    parts = [f"step {global_step + 1}/{total_steps}", f"reward {stats.get('batch/reward/avg', float('nan')):.3f}"]
    if (failed := reward_failures_note(stats)) is not None:
        parts.append(f"failed rewards: {failed}")
    if "teacher/reverse_kl/avg" in stats:  # on-policy distillation: the distance to the teacher, per token
        parts.append(f"teacher KL {stats['teacher/reverse_kl/avg']:.3f}")
    if "eval/pass@1" in stats:
        parts.append(f"pass@1 {stats['eval/pass@1']:.3f}")
    spent = " ".join(f"{label} {seconds:.1f}" for label, seconds in timing if seconds is not None)
    parts.append(f"{stats.get('timeperf/step', 0.0):.1f} s ({spent})")
    if (tokens := stats.get("perf/train_tokens_per_s")) is not None:
        mfu = stats.get("perf/mfu")
        parts.append(f"train {tokens:,.0f} tok/s" + ("" if mfu is None else f" MFU {mfu:.2f}"))
    return "  ".join(parts)


def warn_on_gap(console: Console, config: WeightUpdateConfig, stats: dict[str, float]) -> None:
    """A console warning when the servers' logprobs drift from the trainer's (see ``megarl.actor.gap``)."""
    threshold = config.consistency_threshold if config.gap_threshold is None else config.gap_threshold
    message = gap_warning(stats, threshold) if threshold > 0 else None
    if message is not None:
        logger.warning(message)
        console.line(f"warning: {message}")


def stop_line(reason: object) -> str:
    """The console's line when the run stops on an error of the user's code (e.g. a broken reward)."""
    return f"megarl: the run stopped: {reason}"


def print_summary(console: Console, config: GRPOConfig, summary: dict, seconds: float) -> None:
    """The console's lines at the end of the run: its time, the summary's metrics, where its outputs are."""
    console.line(f"megarl: finished {config.experiment_name}/{config.trial_name} in {seconds / 60:.1f} min")
    for key, values in summary.items():
        console.line(f"  {key}: " + ", ".join(f"{name} {value:.4g}" for name, value in values.items()))
    console.line(f"  metrics: {config.run_dir / 'metrics.jsonl'}\n  plot: {config.run_dir / 'curves.png'}")
    console.line(f"  report: {config.run_dir / 'report.html'} (megarl report)")
    console.line(f"  logs: {config.run_dir / 'logs'}")
