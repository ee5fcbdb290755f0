"""The actor AReaL's training scripts drive: the PPO actor, the weight sync and the rollout batches in one object.

AReaL's GSM8K walkthrough calls everything on its actor::

    actor = PPOActor(config.actor)
    actor.create_process_group(parallel_strategy=config.allocation_mode)
    actor.initialize(None, ft_spec)
    actor.connect_engine(rollout, weight_update_meta)          # once, collective
    for global_step in range(total_steps):
        batch = actor.prepare_batch(dataloader, granularity=actor.config.group_size, workflow=workflow)
        if config.actor.recompute_logprob:
            batch["prox_logp"] = actor.compute_logp(batch)
        actor.compute_advantages(batch)
        actor.ppo_update(batch)
        actor.step_lr_scheduler()
        rollout.pause()
        actor.update_weights(weight_update_meta)               # collective
        actor.set_version(global_step + 1)
        rollout.set_version(global_step + 1)
        rollout.resume()

megarl's own actor (:class:`~megarl.actor.ppo.MegatronPPOActor`) knows nothing of the servers: it
stands below the weight sync (``docs/concepts/architecture.md``). :class:`PPOActor` is that actor
with AReaL's remaining calls, composed from the parts megarl's trainer script holds side by side:
a :class:`~megarl.run.weight_sync.WeightSync` for ``connect_engine`` / ``update_weights`` and a
:class:`~megarl.rollout.coordinator.DistRolloutCoordinator` for ``prepare_batch``. The weight sync
pauses, versions and resumes the rollout side itself; the walkthrough's own ``pause`` /
``set_version`` / ``resume`` around it are harmless repeats.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from megarl.actor.ppo import MegatronPPOActor
from megarl.config.allocation import AllocationMode, TrainingAllocation
from megarl.config.ppo import PPOActorConfig
from megarl.rollout.coordinator import DataParallelLayout, DistRolloutCoordinator
from megarl.run.weight_sync import WeightSync, WeightUpdateMeta, connect_engine


class PPOActor(MegatronPPOActor):
    """:class:`~megarl.actor.ppo.MegatronPPOActor` with AReaL's ``connect_engine``, ``prepare_batch`` and
    ``update_weights``."""

    def __init__(self, config: PPOActorConfig):
        super().__init__(config)
        self.rollout_engine = None
        self.weight_sync: WeightSync | None = None
        self.coordinator: DistRolloutCoordinator | None = None

    def create_process_group(
        self,
        alloc: TrainingAllocation | AllocationMode | str | None = None,
        seed: int = 1,
        parallel_strategy: TrainingAllocation | AllocationMode | str | None = None,
    ):
        """As :meth:`MegatronEngine.create_process_group`; AReaL's keyword ``parallel_strategy`` names the
        allocation too (an allocation-mode string, or its parsed form)."""
        if (alloc is None) == (parallel_strategy is None):
            raise TypeError("create_process_group takes the allocation once: alloc or parallel_strategy")
        return super().create_process_group(alloc if alloc is not None else parallel_strategy, seed)

    def connect_engine(self, rollout, meta: WeightUpdateMeta) -> WeightSync:
        """Connect to the servers once (collective): the weight bridge, the consistency probe, and the
        rollout batches of this rank. ``rollout``: this rank's rollout engine
        (:class:`~megarl.rollout.RemoteInferenceEngine`) on the data-parallel heads (tensor and pipeline
        rank 0), None elsewhere."""
        layout = DataParallelLayout.from_parallel(self.parallel)
        self.rollout_engine = rollout
        self.coordinator = DistRolloutCoordinator(rollout, layout, self.config.group_size)
        self.weight_sync = connect_engine(self, rollout, meta)
        return self.weight_sync

    def prepare_batch(
        self,
        dataloader: Iterable | None,
        granularity: int | None = None,
        workflow=None,
        should_accept_fn: Callable[[dict], bool] | None = None,
        should_accept: Callable[[dict], bool] | None = None,
    ) -> dict[str, Any]:
        """This rank's share of the next training batch (collective): the data-parallel heads gather
        ``dataloader.batch_size`` prompts' accepted trajectories, which are re-split across the trainer in
        whole groups. ``granularity``: rows per group (default ``config.group_size``). ``should_accept``:
        ``should_accept_fn`` by the name of AReaL's multi-turn notebook."""
        if should_accept is not None:
            if should_accept_fn is not None:
                raise TypeError("prepare_batch takes should_accept_fn or should_accept (its older name), not both")
            should_accept_fn = should_accept
        coordinator = self._connected().coordinator
        if granularity is not None and granularity != coordinator.granularity:
            coordinator = DistRolloutCoordinator(coordinator.rollout, coordinator.layout, granularity)
        return coordinator.prepare_batch(dataloader, workflow, should_accept_fn, readmit=self.weight_sync.readmit)

    def update_weights(self, meta: WeightUpdateMeta) -> dict[str, float]:
        """Pause the rollout, stream the new weights into the servers, bump the versions, resume (collective)."""
        return self._connected().weight_sync.update_weights(meta)

    def _connected(self) -> PPOActor:
        if self.weight_sync is None:
            raise RuntimeError("call actor.connect_engine(rollout, weight_update_meta) first")
        return self
