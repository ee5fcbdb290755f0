"""Crash recovery (AReaL's ``RecoverHandler``): dump everything a run needs to continue, load it back.

Layout under ``{run_dir}/recover/``::

    step{N}/model/            Megatron distributed checkpoint (weights, optimizer, LR, version)
    step{N}/critic/           the same of PPO's critic, when the run has one
    step{N}/info_rank{r}.pt   RecoverInfo of rank r (loop position, dataloader, frequencies, RNG)
    step{N}/layout.json       the trainer layout that wrote it
    step{N}/MANIFEST.json     every file above and its size, written last

A dump is written to ``step{N}.tmp/``; once every rank has finished, its files are flushed to
disk, the manifest is written and the directory renamed (``megarl.run.saver.publish_dir``),
and only then are dumps beyond ``recover.keep_last`` deleted. The recover point is the newest
``step{N}`` whose files match its manifest; an incomplete one (no manifest: its write was
interrupted; a file missing or of another size) is skipped with a warning, so a crash at any
moment, or a file lost later, falls back to the previous point. A full disk fails the dump
with a message saying so, removes the partial dump and leaves the previous points as they were.
A point written at one trainer layout loads at another (:meth:`RecoverHandler.load`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megarl.actor.checkpoint import (
    layout_problem,
    model_differences,
    model_problem,
    model_shape,
    read_checkpoint_record,
    rng_state,
    set_rng_state,
)
from megarl.config.experiment import GRPOConfig
from megarl.config.run import RecoverConfig
from megarl.models.build import load_hf_config
from megarl.run.saver import (
    FrequencyControl,
    all_ranks_ok,
    barrier,
    due,
    finish_interrupted_publish,
    incomplete_reason,
    named_engines,
    publish_dir,
    start_tmp_dir,
)
from megarl.utils.errors import require

logger = logging.getLogger(__name__)

_MODEL_PARALLEL = ("pp", "tp", "ep", "expert_tp", "vpp", "cp")


@dataclass
class RecoverInfo:
    """One rank's position in the run, besides the engine state."""

    epoch: int
    """Epoch of the last finished step."""
    epoch_step: int
    """Step within that epoch of the last finished step."""
    global_step: int
    """Global step of the last finished step (the run continues at ``global_step + 1``)."""
    rollout_version: int
    """Weight version of the rollout side."""
    dataloader_state: dict = field(default_factory=dict)
    """The dataloader's ``state_dict()``."""
    saver_state: dict = field(default_factory=dict)
    """``Saver.state_dict()``."""
    evaluator_state: dict = field(default_factory=dict)
    """``Evaluator.state_dict()``."""
    recover_state: dict = field(default_factory=dict)
    """The handler's own frequency counters (filled in by :meth:`RecoverHandler.maybe_dump`)."""
    rng_state: dict = field(default_factory=dict, repr=False)
    """This rank's RNG states, ``megarl.actor.checkpoint.rng_state()`` (filled in by ``maybe_dump``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the trainer wants back."""


def saved_layout(point: Path) -> dict:
    """The trainer layout that wrote the recover point ``point`` (world size, dp and each model-parallel size)."""
    return {"cp": 1, **json.loads((point / "layout.json").read_text())}  # points from before CP: 1


def _layout(engine) -> dict:
    alloc = engine.parallel.alloc
    return {"world_size": engine.parallel.world_size, "dp": alloc.dp, **{k: getattr(alloc, k) for k in _MODEL_PARALLEL}}


class RecoverHandler:
    """Writes and reads the recover point of ``run_dir`` according to ``config.mode``.

    ``disabled``: never dumps, never loads. ``auto``: dumps, loads when a recover point
    exists. ``resume``: dumps, and a recover point must exist.
    """

    def __init__(self, config: RecoverConfig, run_dir: Path):
        self.config = config
        self.root = Path(run_dir) / "recover"
        self.freq = FrequencyControl(freq_steps=config.freq_steps, freq_secs=config.freq_secs)
        self._last_step: int | None = None  # global step of the newest dump written or loaded

    # ------------------------------------------------------------------ dump

    def maybe_dump(self, engines, info: RecoverInfo, force: bool = False) -> bool:
        """Dump when a frequency is reached (or ``force``); collective. True when a dump was written.

        ``engines``: the actor, or ``{"model": actor, "critic": critic}`` (``named_engines``).

        A second dump of the step already dumped is skipped: nothing trained since, and
        replacing the directory ``latest`` names would open a window without a recover point.
        """
        if self.config.mode == "disabled" or not due(self.freq, info.epoch_step, None, force):
            return False
        if info.global_step == self._last_step:
            return False
        from megarl.actor.checkpoint import SaveLoadMeta

        engines = named_engines(engines)
        engine = engines["model"]
        p = engine.parallel
        final = self.root / f"step{info.global_step}"
        tmp = final.with_name(final.name + ".tmp")
        start_tmp_dir(tmp)
        full_disk = None
        try:
            for name, each in engines.items():
                each.save(SaveLoadMeta(str(tmp / name), weight_format="megatron", with_optim=True))
            info = dataclasses.replace(info, recover_state=self.freq.state_dict(), rng_state=rng_state())
            torch.save(dataclasses.asdict(info), tmp / f"info_rank{p.rank}.pt")
            if p.rank == 0:
                (tmp / "layout.json").write_text(json.dumps(_layout(engine)))
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            full_disk = err
        if not all_ranks_ok(full_disk is None):  # every rank learns that one ran out of space
            if p.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            barrier()
            kept = ", ".join(path.name for path in self.points()) or "none"
            raise OSError(
                errno.ENOSPC,
                f"no space left on the device of {self.root} while writing recover point "
                f"{final.name}: the partial dump was removed; the previous points are intact ({kept}); "
                f"free space or move cluster.fileroot, then resume with recover.mode=auto",
            )
        if p.rank == 0:
            publish_dir(tmp, final)
            self._prune()
            logger.info("recover point written to %s", final)
        barrier()
        self._last_step = info.global_step
        return True

    def rewrite(self, engines, info: RecoverInfo) -> None:
        """Write the point just loaded (:meth:`load` returned ``info``) again as ``engines`` now save it, e.g.
        with another ``optimizer.checkpoint_layout``; collective. The old point stays until the new is complete."""
        self._last_step = None
        self.maybe_dump(engines, info, force=True)

    def _prune(self) -> None:
        """Delete interrupted ``.tmp`` dumps and all but the ``keep_last`` newest points."""
        for path in self.root.glob("step*.tmp"):
            shutil.rmtree(path)
        for path in self.points()[self.config.keep_last :]:
            shutil.rmtree(path)

    # ------------------------------------------------------------------ load

    def points(self) -> list[Path]:
        """Every ``step{N}`` directory (complete or not), newest first."""
        if not self.root.is_dir():
            return []
        steps = [p for p in self.root.iterdir() if p.is_dir() and re.fullmatch(r"step\d+", p.name)]
        return sorted(steps, key=lambda p: int(p.name[4:]), reverse=True)

    def latest(self) -> Path | None:
        """The newest complete recover point, or None; newer incomplete ones are skipped with a warning."""
        finish_interrupted_publish(self.root)
        for path in self.points():
            reason = incomplete_reason(path)
            if reason is None:
                return path
            logger.warning("recover point %s is incomplete (%s): skipped, trying the one before", path, reason)
        return None

    def load(self, engines, share: tuple[int, int] | None = None) -> RecoverInfo | None:
        """Restore ``engines`` (as for :meth:`maybe_dump`) and this rank's RNG from the recover point;
        its RecoverInfo, or None.

        The trainer's layout may differ from the dump's (data, tensor, pipeline, virtual pipeline,
        expert, context parallel sizes): the Megatron checkpoints reshard (the distributed optimizer's
        state when written per parameter, ``optimizer.checkpoint_layout: any``); every rank takes rank
        0's run and data position (the same on every rank), keeps the RNG the checkpoint restored (one
        state per pipeline / tensor-parallel coordinate) instead of another rank's, and ``share``, a
        data-parallel head's ``(dp_rank, dp_size)``, gets its part of all the prompts in flight at the
        dump; other ranks get none.
        """
        if self.config.mode == "disabled":
            if self.points():
                logger.warning("recover.mode=disabled: ignoring the recover point in %s, starting fresh", self.root)
            return None
        path = self.latest()
        if path is None:
            if self.config.mode == "resume":
                found = (
                    f"only incomplete ones ({', '.join(p.name for p in self.points())})" if self.points() else "none"
                )
                raise FileNotFoundError(f"recover.mode=resume but {self.root} holds no complete recover point: {found}")
            logger.info("no recover point in %s: starting fresh", self.root)
            return None
        return self._load(named_engines(engines), path, share)

    def _load(self, engines: dict, path: Path, share: tuple[int, int] | None) -> RecoverInfo:
        from megarl.actor.checkpoint import SaveLoadMeta

        engine = engines["model"]
        saved = saved_layout(path)
        now = _layout(engine)
        for name, each in engines.items():
            if not (path / name).is_dir():
                raise FileNotFoundError(
                    f"recover point {path} has no {name}/ checkpoint, but this run has a {name}: it was written "
                    f"by a run without one (recover.mode=disabled, or another trial_name, starts fresh)"
                )
            each.load(SaveLoadMeta(str(path / name), weight_format="megatron", with_optim=True))
        if saved == now:
            info = RecoverInfo(**_read_info(path, engine.parallel.rank))
            set_rng_state(info.rng_state)
        else:
            info = self._info_at_another_layout(path, saved, share)
            changed = ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v)
            logger.info("recover point %s was written at another layout (%s): resharded", path, changed)
        self.freq.load_state_dict(info.recover_state)
        self._last_step = info.global_step
        logger.info("recovered from %s at global step %d", path, info.global_step)
        return info

    @staticmethod
    def _info_at_another_layout(path: Path, saved: dict, share: tuple[int, int] | None) -> RecoverInfo:
        """Rank 0's info without its RNG, and this rank's share of every saved rank's prompts in flight."""
        info = RecoverInfo(**_read_info(path, 0))
        mine = []
        if share is not None:
            pending = [
                item
                for r in range(saved["world_size"])
                for item in _read_info(path, r)["extra"].get("pending_items", [])
            ]
            mine = pending[share[0] :: share[1]]
        return dataclasses.replace(info, rng_state={}, extra={**info.extra, "pending_items": mine})


def _read_info(path: Path, rank: int) -> dict:
    return torch.load(path / f"info_rank{rank}.pt", weights_only=True)


def check_point_loads(config: GRPOConfig) -> None:
    """The recover point ``config``'s run would resume from loads into its models at its layout: another
    model is refused naming ``actor.path`` (``critic.path``), other LoRA adapters (rank, targets, scale)
    ``actor.lora`` (``critic.lora``), per-rank optimizer shards at another model-parallel layout
    ``allocation_mode``; a ``total_train_steps`` the point has reached already, ``total_train_steps``."""
    train = config.allocation.train
    point = RecoverHandler(config.recover, config.run_dir).latest()
    if point is None or train is None:
        return
    after = int(point.name.removeprefix("step"))  # latest() put back any step{N}.old
    require(
        config.total_train_steps is None or config.total_train_steps > after,
        "total_train_steps",
        config.total_train_steps,
        f"the recover point {point} is after step {after} (the run's step {after + 1}): resuming would have "
        f"nothing to train and overwrite its checkpoints with later weights; set total_train_steps={after + 2} "
        "or more to train on, or start fresh (another trial_name)",
    )
    for key, settings, name in (("actor", config.actor, "model"), ("critic", config.critic, "critic")):
        if settings is None or not (point / name).is_dir():
            continue  # a point without the critic's checkpoint: the trainer says so
        saved = read_checkpoint_record(point / name)
        local = Path(settings.path).expanduser()
        if (local / "config.json").is_file():  # a short name not fetched yet is checked when the trainer loads
            shape = model_shape(load_hf_config(local).to_dict(), settings.lora)
            problem = model_problem(saved, shape)
            if model_differences(saved, shape) == ["lora"]:  # the same model, other adapters
                require(problem is None, f"{key}.lora", settings.lora, f"recover point {point / name} {problem}")
            require(problem is None, f"{key}.path", settings.path, f"recover point {point / name} {problem}")
        problem = layout_problem(saved, train)
        require(
            problem is None,
            "allocation_mode",
            config.allocation_mode,
            f"recover point {point / name} {problem}",
            related=(f"{key}.optimizer.checkpoint_layout",),
        )
