"""Rewrite a run's newest recover point so that it loads at any parallel layout.

A point written with ``optimizer.checkpoint_layout: data_parallel`` (the default) holds the distributed
optimizer's state as each rank's shard, which loads at another data-parallel size only: a run that
must go on at another tensor, pipeline or expert-parallel size (it ran out of memory, it got more
GPUs) cannot resume it. This module loads the point at the layout that wrote it, on as many ranks as
wrote it, and writes it again in place with the state per parameter (``checkpoint_layout: any``):
weights, optimizer state, LR schedule, counters, RNG states and the prompts in flight are the same.

``megarl convert-point CONFIG [key=value ...]`` runs it under torchrun on this machine; on a cluster,
run ``python -m megarl.run.convert_point --config FILE`` with the point's world size under your
launcher (one process per rank, ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` set as torchrun sets them).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from pathlib import Path

from megarl.actor.checkpoint import holds_per_rank_optimizer, read_checkpoint_record
from megarl.actor.engine import MegatronEngine
from megarl.config import GRPOConfig
from megarl.config.allocation import TrainingAllocation
from megarl.run.components import build_critic
from megarl.run.prelaunch import load_expr_config
from megarl.run.recover import RecoverHandler, saved_layout

logger = logging.getLogger(__name__)

_LR_STEPS = 1_000_000
"""The LR schedule's length the engines are built with: the point's own schedule replaces it on load."""


def point_to_convert(config: GRPOConfig) -> Path:
    """The newest complete recover point of ``config``'s run; FileNotFoundError naming the run without one."""
    handler = _handler(config)
    point = handler.latest()
    if point is None:
        raise FileNotFoundError(f"{handler.root} holds no complete recover point to convert")
    return point


def _handler(config: GRPOConfig) -> RecoverHandler:
    """The run's recover points, read (and written) whatever ``recover.mode`` the config says."""
    return RecoverHandler(replace(config.recover, mode="resume"), config.run_dir)


def needs_conversion(point: Path) -> bool:
    """Whether a model of ``point`` (the actor's, the critic's) holds its optimizer state as per-rank shards."""
    models = [point / name for name in ("model", "critic") if (point / name).is_dir()]
    return any(holds_per_rank_optimizer(read_checkpoint_record(path)) for path in models)


def saved_allocation(point: Path) -> TrainingAllocation:
    """The parallel layout that wrote ``point``."""
    s = saved_layout(point)
    return TrainingAllocation(
        dp=s["dp"], pp=s["pp"], tp=s["tp"], ep=s["ep"], etp=s["expert_tp"], vpp=s["vpp"], cp=s["cp"]
    )


def saved_world_size(point: Path) -> int:
    """How many ranks wrote ``point``: the converter runs on as many."""
    return int(saved_layout(point)["world_size"])


def convert(config: GRPOConfig) -> Path:
    """Load the newest recover point at its own layout and write it again with ``checkpoint_layout: any``;
    collective over the point's world size. Returns the point."""
    point = point_to_convert(config)
    config = per_parameter(config)
    actor = MegatronEngine(config.actor)
    parallel = actor.create_process_group(saved_allocation(point), seed=config.seed)
    actor.initialize(ft_spec=_LR_STEPS)
    engines = {"model": actor}
    if config.critic is not None and (point / "critic").is_dir():
        engines["critic"] = build_critic(config, parallel, _LR_STEPS)
    handler = _handler(config)
    try:
        info = handler.load(engines)
        handler.rewrite(engines, info)
    finally:
        for engine in engines.values():
            engine.destroy()
    return point


def per_parameter(config: GRPOConfig) -> GRPOConfig:
    """``config`` with the actor's and the critic's optimizer state written per parameter (``any``)."""
    actor = replace(config.actor, optimizer=replace(config.actor.optimizer, checkpoint_layout="any"))
    critic = config.critic
    if critic is not None and critic.optimizer is not None:
        critic = replace(critic, optimizer=replace(critic.optimizer, checkpoint_layout="any"))
    return replace(config, actor=actor, critic=critic)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    # recover.mode=disabled: the config check would refuse the very point this converts
    args = [*(sys.argv[1:] if argv is None else argv), "recover.mode=disabled"]
    config, rest = load_expr_config(args, GRPOConfig)
    if rest:
        raise SystemExit(f"megarl.run.convert_point: unexpected arguments {rest}; overrides are key.path=value")
    point = convert(config)
    logger.info("recover point %s rewritten with optimizer.checkpoint_layout=any: it loads at any layout", point)
    return 0


if __name__ == "__main__":
    sys.exit(main())
