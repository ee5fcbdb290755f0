"""An earlier run in the directory a fresh run is about to write: moved aside, not overwritten.

Every run writes ``{fileroot}/{experiment_name}/{trial_name}/``, and the bundled configs fix the trial
name, so running a config again targets the same directory. A run that resumes (``recover.mode: auto``
or ``resume`` with a recover point there) continues the earlier one's files; a run that starts fresh
would replace its ``config.yaml`` and drop its ``metrics.jsonl``. ``megarl run`` and ``megarl slurm``
call :func:`keep_earlier_run` before they write anything: the earlier run's directory is renamed to
``{trial_name}-{time it started}`` beside it, whole.
"""

from __future__ import annotations

import time
from pathlib import Path

from megarl.config import GRPOConfig


def has_recover_point(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a written recover point (``recover/step{N}/MANIFEST.json``; loading it checks
    that it is whole)."""
    return any((run_dir / "recover").glob("step*/MANIFEST.json"))


def resumes(config: GRPOConfig) -> bool:
    """Whether the run continues from a recover point in its directory instead of starting fresh."""
    return config.recover.mode != "disabled" and has_recover_point(config.run_dir)


def _steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    with open(metrics, "rb") as f:
        return sum(1 for line in f if line.strip())


def _aside(run_dir: Path) -> Path:
    """A free name beside ``run_dir``: its trial name and when the earlier run started (its config's time)."""
    started = run_dir / "config.yaml"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime((started if started.exists() else run_dir).stat().st_mtime))
    target = run_dir.with_name(f"{run_dir.name}-{stamp}")
    n = 2
    while target.exists():
        target = run_dir.with_name(f"{run_dir.name}-{stamp}-{n}")
        n += 1
    return target


def keep_earlier_run(config: GRPOConfig) -> str | None:
    """Move the run directory aside when it holds an earlier run's steps and this run starts fresh; what
    was done, for the console, or None when nothing was (no earlier steps, or this run resumes them)."""
    run_dir = config.run_dir
    steps = _steps_logged(run_dir)
    if steps == 0 or resumes(config):
        return None
    target = _aside(run_dir)
    run_dir.rename(target)
    return (
        f"{run_dir} held an earlier run ({steps} steps logged) and this one starts fresh "
        f"(recover.mode={config.recover.mode}): the earlier run was moved to {target}, whole; "
        f"trial_name=... keeps runs apart, recover.mode=auto continues a run from its recover point"
    )
