"""Periodic checkpoints (AReaL's ``Saver``) and the frequency control shared by the run utilities.

:class:`FrequencyControl` decides when something periodic is due (every N epochs, N steps
or N seconds); :func:`due` turns a trainer step into that decision, identical on every
rank. :class:`Saver` writes ``{run_dir}/checkpoints/globalstep{N}/`` (a Megatron
distributed checkpoint, optionally an HF export in ``hf/``) and keeps the newest few.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config.run import SaverConfig

logger = logging.getLogger(__name__)


class FrequencyControl:
    """Counts epochs, steps and seconds since the last trigger; any set frequency reached triggers.

    Counts are the same on every rank; elapsed time is not, so with ``freq_secs`` set
    :meth:`check` takes rank 0's decision (a collective when torch.distributed is up:
    every rank must call it).
    """

    def __init__(self, freq_epochs: int | None = None, freq_steps: int | None = None, freq_secs: float | None = None):
        self.freq_epochs = freq_epochs
        self.freq_steps = freq_steps
        self.freq_secs = freq_secs
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (as right after a trigger)."""
        self.epochs = 0
        self.steps = 0
        self.start = time.monotonic()

    def _reached(self) -> bool:
        return (
            (self.freq_epochs is not None and self.epochs >= self.freq_epochs)
            or (self.freq_steps is not None and self.steps >= self.freq_steps)
            or (self.freq_secs is not None and time.monotonic() - self.start >= self.freq_secs)
        )

    def check(self, epochs: int = 0, steps: int = 1) -> bool:
        """Add ``epochs`` / ``steps`` done; True (and reset) when a set frequency is reached."""
        self.epochs += epochs
        self.steps += steps
        reached = self._reached()
        if self.freq_secs is not None:
            reached = rank0_decision(reached)
        if reached:
            self.reset()
        return reached

    def state_dict(self) -> dict:
        """Counters since the last trigger (elapsed seconds instead of a clock reading)."""
        return {"epochs": self.epochs, "steps": self.steps, "elapsed": time.monotonic() - self.start}

    def load_state_dict(self, state: dict) -> None:
        """Resume counting from :meth:`state_dict`'s counters."""
        self.epochs = state["epochs"]
        self.steps = state["steps"]
        self.start = time.monotonic() - state["elapsed"]


def named_engines(engines) -> dict:
    """``{name: engine}`` of what a checkpoint holds: ``model`` (the actor) and e.g. ``critic``.

    A single engine is ``{"model": engine}``; each is written to the checkpoint's ``name/`` folder.
    """
    named = dict(engines) if isinstance(engines, dict) else {"model": engines}
    if "model" not in named:
        raise ValueError(f"a checkpoint needs the actor under 'model', got {sorted(named)}")
    return named


def rank0_decision(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank of the default group (``flag`` itself without torch.distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    box = [bool(flag)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def due(freq: FrequencyControl, epoch_step: int, steps_per_epoch: int | None, force: bool) -> bool:
    """Count one trainer step (an epoch too when it is the epoch's last) and say whether ``freq`` fires.

    ``force`` fires regardless and restarts the counts.
    """
    last_of_epoch = steps_per_epoch is not None and epoch_step + 1 == steps_per_epoch
    fired = freq.check(epochs=int(last_of_epoch), steps=1)
    if force and not fired:
        freq.reset()
    return fired or force


def check_epoch_frequency(freq_epochs: int | None, steps_per_epoch: int | None, owner: str) -> None:
    """Raise when an epoch frequency is set but the epoch length is unknown."""
    if freq_epochs is not None and steps_per_epoch is None:
        raise ValueError(f"{owner}.freq_epochs={freq_epochs} needs steps_per_epoch (the dataloader length)")


def barrier() -> None:
    """``dist.barrier()`` when torch.distributed is up."""
    if dist.is_initialized():
        dist.barrier()


def all_ranks_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of the default group (``ok`` itself without torch.distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def global_rank() -> int:
    """This process's rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def start_tmp_dir(tmp: Path) -> None:
    """Rank 0 replaces a leftover (interrupted) ``tmp`` with an empty one; every rank waits (collective)."""
    if global_rank() == 0:
        if tmp.exists():
            logger.warning("removing %s, left by an interrupted write", tmp)
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()


MANIFEST = "MANIFEST.json"
"""Written last into a checkpoint: every file and its size. A directory without it, or whose files
differ from it, is incomplete (an interrupted write, a truncated or deleted file) and never loaded."""


def publish_dir(tmp: Path, final: Path) -> None:
    """Publish a fully written ``tmp`` directory as ``final`` (replacing an older ``final``).

    Every file is flushed to disk, then :data:`MANIFEST` is written and flushed, then the
    directory renamed: after a crash at any point ``final`` is either absent or complete. An older
    ``final`` is removed only once the new one is in place (put back if the rename fails).
    """
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(path)
        files[str(path.relative_to(tmp))] = path.stat().st_size
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"files": files}, indent=0))
    _fsync(manifest)
    if not final.exists():
        tmp.rename(final)
        _fsync(final.parent)
        return
    old = final.with_name(final.name + ".old")  # the older final stays whole until the new one is in place
    shutil.rmtree(old, ignore_errors=True)
    final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:
        old.rename(final)
        raise
    _fsync(final.parent)
    shutil.rmtree(old)


def finish_interrupted_publish(root: Path) -> None:
    """Undo what a crash between :func:`publish_dir`'s two renames left in ``root``: a ``{name}.old``
    (the complete older directory) without its ``{name}`` is put back, one beside its ``{name}`` is removed.

    Safe on several ranks at once (on a shared file system each may find the other's rename done).
    """
    for old in root.glob("*.old") if root.is_dir() else ():
        final = old.with_name(old.name.removesuffix(".old"))
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            continue
        try:
            old.rename(final)
        except FileNotFoundError:  # another rank put it back first
            continue
        logger.warning("%s was being replaced when the run stopped: the older %s is back in place", final, final.name)


def incomplete_reason(path: Path) -> str | None:
    """Why the checkpoint directory ``path`` cannot be loaded (see :data:`MANIFEST`), or None."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (its write was interrupted)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its {MANIFEST} is unreadable ({err})"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory) to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Saver:
    """Periodic checkpoints under ``{run_dir}/checkpoints/globalstep{N}/``.

    Each is written to ``globalstep{N}.tmp`` and renamed once every rank has finished, so
    a directory without the suffix is complete. Contents: ``model/`` (Megatron distributed
    checkpoint, with the optimizer state unless ``config.with_optim`` is false; ``engine.load``
    reads it back), ``hf/`` when ``config.export_hf``, the same as ``critic/`` and ``critic_hf/``
    for PPO's critic, and ``meta.json`` (epoch, steps, version).

    Args:
        config: Frequencies, HF export and how many checkpoints to keep.
        run_dir: The run's output directory.
        steps_per_epoch: Trainer steps per epoch; required for ``config.freq_epochs``.
    """

    def __init__(self, config: SaverConfig, run_dir: Path, steps_per_epoch: int | None = None):
        check_epoch_frequency(config.freq_epochs, steps_per_epoch, "saver")
        self.config = config
        self.root = Path(run_dir) / "checkpoints"
        self.steps_per_epoch = steps_per_epoch
        self.freq = FrequencyControl(config.freq_epochs, config.freq_steps, config.freq_secs)
        self._last_step: int | None = None  # global step of the newest checkpoint this Saver wrote

    def maybe_save(self, engines, epoch: int, epoch_step: int, global_step: int, force: bool = False) -> Path | None:
        """Save when a frequency is reached (or ``force``); collective. Returns the checkpoint dir or None.

        ``engines``: the actor, or ``{"model": actor, "critic": critic}`` (:func:`named_engines`).
        A second save of the step just saved (a final forced save after a periodic one) is skipped.
        """
        if not due(self.freq, epoch_step, self.steps_per_epoch, force) or global_step == self._last_step:
            return None
        from megarl.actor.checkpoint import SaveLoadMeta

        final = self.root / f"globalstep{global_step}"
        tmp = final.with_name(final.name + ".tmp")
        start_tmp_dir(tmp)
        engines = named_engines(engines)
        for name, engine in engines.items():
            engine.save(SaveLoadMeta(str(tmp / name), weight_format="megatron", with_optim=self.config.with_optim))
            if self.config.export_hf:
                engine.export_hf(tmp / ("hf" if name == "model" else f"{name}_hf"))
        version = engines["model"].get_version()
        meta = {"epoch": epoch, "epoch_step": epoch_step, "global_step": global_step, "version": version}
        barrier()
        if global_rank() == 0:
            (tmp / "meta.json").write_text(json.dumps(meta))
            publish_dir(tmp, final)
            self._prune()
            logger.info("saved checkpoint %s", final)
        barrier()
        self._last_step = global_step
        return final

    def _prune(self) -> None:
        """Delete interrupted ``.tmp`` dirs and all but the ``keep_last`` newest checkpoints."""
        finish_interrupted_publish(self.root)
        steps = {}
        for path in self.root.iterdir():
            match = re.fullmatch(r"globalstep(\d+)(\.tmp)?", path.name)
            if match and match[2]:
                shutil.rmtree(path)
            elif match:
                steps[int(match[1])] = path
        for step in sorted(steps)[: -self.config.keep_last]:
            shutil.rmtree(steps[step])

    def state_dict(self) -> dict:
        """The frequency counters (for recovery)."""
        return {"freq": self.freq.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.freq.load_state_dict(state["freq"])
