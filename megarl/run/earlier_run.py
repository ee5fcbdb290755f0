"""An earlier run in the directory a fresh run is about to write: moved aside, not overwritten.

Every run writes ``{fileroot}/{experiment_name}/{trial_name}/``, and the bundled configs fix the trial
name, so running a config again targets the same directory. A run that resumes (``recover.mode: auto``
or ``resume`` with a recover point there) continues the earlier one's files; a run that starts fresh
would replace its ``config.yaml`` and drop its ``metrics.jsonl``. ``megarl run`` and ``megarl slurm``
call :func:`keep_earlier_run` before they write anything: the earlier run's directory is renamed to
``{trial_name}-{time it started}`` beside it, whole.

A run that is still going is no earlier run: ``megarl run`` holds its directory for its whole life with
an exclusive ``flock`` on ``{run_dir}/.megarl.lock`` (:func:`claim_run_dir`), and a second start on it
(``megarl run`` or ``megarl slurm``) is refused before it touches the directory.

A run that resumes with settings changed from the run's (:func:`keep_resumed_config`) keeps the
config the earlier steps were trained with as ``config-until-step{N}.yaml`` beside the new
``config.yaml`` and says what changed: a run's directory tells which steps ran under which settings.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from omegaconf import OmegaConf

from megarl.config import GRPOConfig, to_yaml
from megarl.run.saver import incomplete_reason
from megarl.utils.logging import WarnOnce

logger = logging.getLogger(__name__)

LOCK_FILE = ".megarl.lock"
"""The file in the run directory that a live ``megarl run`` holds an exclusive ``flock`` on; it says who."""


def has_recover_point(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a whole recover point (``recover/step{N}/``, its files as its manifest lists
    them): one the trainer would resume from. A run whose points are all damaged starts fresh."""
    return bool(_whole_point_steps(run_dir))


def _whole_point_steps(run_dir: Path) -> list[int]:
    """The steps of the whole recover points in ``run_dir`` (``recover/step{N}/``)."""
    points = [manifest.parent for manifest in (run_dir / "recover").glob("step*/MANIFEST.json")]
    return [int(p.name[4:]) for p in points if p.name[4:].isdigit() and incomplete_reason(p) is None]


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
    """Move the run directory aside when it holds an earlier run's steps and this run starts fresh, or
    keep its config when this run resumes it with other settings (:func:`keep_resumed_config`); what was
    done, for the console, or None when nothing was."""
    run_dir = config.run_dir
    if resumes(config):
        return keep_resumed_config(config)
    steps = _steps_logged(run_dir)
    if steps == 0:
        return None
    target = _aside(run_dir)
    run_dir.rename(target)
    return (
        f"{run_dir} held an earlier run ({steps} steps logged) and this one starts fresh "
        f"(recover.mode={config.recover.mode}): the earlier run was moved to {target}, whole; "
        f"trial_name=... keeps runs apart, recover.mode=auto continues a run from its recover point"
    )


CHANGES_SHOWN = 12
"""Changed settings a resumed run lists by name; the rest are counted."""


def config_changes(before: dict, after: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """The settings whose values differ between two config trees, as (dotted key, before, after); a key
    only one of them has is None in the other. Lists are compared whole."""
    changes = []
    for key in sorted(set(before) | set(after), key=str):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += config_changes(old, new, f"{prefix}{key}.")
        elif old != new:
            changes.append((f"{prefix}{key}", old, new))
    return changes


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def keep_resumed_config(config: GRPOConfig) -> str | None:
    """For a run that resumes: when ``config`` differs from the run's saved ``config.yaml`` (which the
    new one replaces), keep the saved one as ``config-until-step{N}.yaml`` (N: the recover point's step)
    and say which settings changed, for the console and the log; None when nothing changed."""
    saved = config.run_dir / "config.yaml"
    if not saved.is_file():
        return None
    after = OmegaConf.to_container(OmegaConf.create(to_yaml(config)), resolve=True)
    try:
        before = OmegaConf.to_container(OmegaConf.load(saved), resolve=True)
    except Exception as err:  # a damaged file must not stop the resume: it is kept and said
        before, unreadable = None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    else:
        unreadable = None if isinstance(before, dict) else f"it holds a {type(before).__name__}, not settings"
    changes = config_changes(before, after) if unreadable is None else []
    if unreadable is None and not changes:
        return None
    step = max(_whole_point_steps(config.run_dir), default=0)
    kept = saved.with_name(f"config-until-step{step}.yaml")
    n = 2
    while kept.exists():
        kept = saved.with_name(f"config-until-step{step}-{n}.yaml")
        n += 1
    kept.write_bytes(saved.read_bytes())
    where = f"(kept as {kept.name}; the steps from {step + 1} on follow the new one)"
    if unreadable is not None:
        message = (
            f"{config.run_dir} resumes after step {step}; the run's config {where} could not be read: {unreadable}"
        )
    else:
        listed = "; ".join(f"{key} {_short(old)} -> {_short(new)}" for key, old, new in changes[:CHANGES_SHOWN])
        more = f"; and {len(changes) - CHANGES_SHOWN} more" if len(changes) > CHANGES_SHOWN else ""
        message = (
            f"{config.run_dir} resumes after step {step} with {len(changes)} setting(s) changed from the run's "
            f"config {where}: {listed}{more}"
        )
    logger.warning(message)
    return message


class RunDirInUse(ValueError):
    """The run directory is held by a live run (another ``megarl run`` on the same trial)."""


class RunDirLock:
    """An exclusive ``flock`` on ``{run_dir}/.megarl.lock``: held until :meth:`release`, or until this
    process ends however it ends (the kernel drops the lock with the last descriptor, on SIGKILL too).
    The descriptor is close-on-exec and no child is forked without exec, so the servers and the trainer,
    which outlive a killed launcher for a few seconds, do not keep the lock."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the lock
            self._fd = None


_warn_unlockable = WarnOnce(logger)  # a filesystem without flock: said once per process


def lock_run_dir(run_dir: Path) -> RunDirLock | None:
    """Hold ``run_dir`` (made if missing) for this process, or raise :class:`RunDirInUse` naming its
    holder, having changed nothing; None where the filesystem takes no ``flock`` (warned once).

    ``flock`` on a network filesystem needs the filesystem's support for it (NFS emulates it with its
    byte-range locks; Lustre needs the ``flock`` mount option). Where it is missing the run goes on
    unguarded rather than not at all.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # no O_TRUNC: the holder's text stays
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that has not said which yet"
        os.close(fd)
        raise RunDirInUse(
            f"{run_dir} is in use by a run that is still going ({holder}; it holds {path}): wait for it to end, "
            f"stop it, or start this one with another trial_name=..."
        ) from None
    except OSError as err:
        os.close(fd)
        _warn_unlockable(
            "cannot lock %s (%s): the filesystem takes no flock, so a second start on this trial "
            "would not see that this run is going; give each run its own trial_name",
            path,
            err,
        )
        return None
    holder = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{holder}\n".encode(), 0)
    return RunDirLock(path, fd)


def claim_run_dir(config: GRPOConfig) -> tuple[RunDirLock | None, str | None]:
    """Hold the run directory for this process (:func:`lock_run_dir`), first moving an earlier run aside
    or keeping a resumed run's config (:func:`keep_earlier_run`); the lock and what was done, for the
    console. A directory that a live run holds raises :class:`RunDirInUse` before anything in it is touched."""
    lock = lock_run_dir(config.run_dir)  # held while the earlier run moves: no second start moves it too
    try:
        moved = keep_earlier_run(config)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if moved is None or config.run_dir.is_dir():  # still there: a resumed run's config kept, nothing moved
        return lock, moved
    if lock is not None:
        lock.release()  # its file went with the earlier run; the new directory gets its own
    return lock_run_dir(config.run_dir), moved
