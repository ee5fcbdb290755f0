"""The trainer's end of the rollout pool: accepted trajectories out of the episode queues, oldest weights first.

A trajectory holding a token older than the staleness bound allows is dropped here, at hand-off
(:mod:`megarl.rollout.staleness`); a dataloader item's runs again, first, with the current weights (up to
:data:`MAX_STALE_RERUNS` times), so that no prompt of the epoch is skipped. Every hand-off records the
staleness of what it handed over and the queues' depths (:class:`~megarl.rollout.episodes.HandoffStats`).
"""

from __future__ import annotations

import heapq
import time

import torch

from megarl.api.engine_api import GenerationEngine
from megarl.rollout.episodes import EpisodeQueues, HandoffStats, Result, RolloutError, logger
from megarl.rollout.runner import EpisodeRunner
from megarl.rollout.staleness import StalenessManager
from megarl.utils import stats_tracker

MAX_STALE_RERUNS = 3
"""A dataloader item whose trajectory came too late runs again this often at most."""
STUCK_WAIT_WARN_S = 30.0
"""A wait blocked this long for more results than are ready, running or queued says so: only items
submitted from now on (by another thread) can complete it."""


class HandOff:
    """Takes results from ``queues`` for the trainer, under ``staleness`` at ``engine``'s version.

    Args:
        engine: Its ``get_version()`` is the version results are judged stale against.
        queues: What the pool's two sides share.
        staleness: The pool's budget; a dropped result leaves it.
        runner: The event loop that runs the episodes (woken when a stale item is queued again or more
            results are wanted).
    """

    def __init__(
        self, engine: GenerationEngine, queues: EpisodeQueues, staleness: StalenessManager, runner: EpisodeRunner
    ):
        self.engine, self._q, self.staleness, self._runner = engine, queues, staleness, runner
        self._stats = HandoffStats()

    def check_running(self) -> None:
        """Raise unless the pool's loop runs (a stopped pool hands nothing over)."""
        if not self._runner.thread.started or self._q.stopping:
            raise RuntimeError("RolloutPool is not running: call start() (or engine.initialize()) first")

    def take(self, max_count: int, min_count: int, timeout: float | None, fail_on_stale: bool = False) -> list[Result]:
        """Pop between ``min_count`` and ``max_count`` results, oldest first, or [] on timeout.

        ``fail_on_stale``: raise at once when stale drops leave fewer than ``min_count`` that
        can still arrive (queued, running or ready), rather than wait for the timeout.
        """
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        dropped: list[int] = []
        warned = False
        with self._q.cond:
            try:
                while True:
                    if self._q.errors:
                        raise self._q.errors.pop(0)
                    dropped += self._drop_stale_locked()
                    if len(self._q.results) >= min_count:
                        n = min(max_count, len(self._q.results))
                        taken = [heapq.heappop(self._q.results) for _ in range(n)]
                        for result in taken:
                            self._q.pending.pop(result.task_id, None)
                        return taken
                    can_arrive = len(self._q.results) + self._q.n_running + len(self._q.input)
                    if fail_on_stale and dropped and can_arrive < min_count:
                        raise RolloutError(self._stale_message(min_count, can_arrive, dropped))
                    self.check_running()
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return []
                    if not warned and time.monotonic() - start >= STUCK_WAIT_WARN_S:
                        warned = self._warn_stuck(min_count, can_arrive, time.monotonic() - start)
                    self._raise_demand(min_count)
                    self._q.cond.wait(STUCK_WAIT_WARN_S if remaining is None else min(remaining, STUCK_WAIT_WARN_S))
            finally:
                self._q.demand = 0

    def record(self, results: list[Result], batch: bool = False) -> None:
        """Record the hand-off of ``results`` (``batch``: a whole training batch)."""
        with self._q.cond:
            depths = dict(
                input_queue_depth=len(self._q.input), output_queue_depth=len(self._q.results), running=self._q.n_running
            )
        self._stats.record(results, self.engine.get_version(), depths, batch)

    def _drop_stale_locked(self) -> list[int]:
        """Discard accepted training trajectories older than the staleness bound allows; their versions."""
        floor = self.staleness.min_allowed_version(self.engine.get_version())
        dropped = []
        while self._q.results and self._q.results[0].oldest < floor and not self._q.results[0].is_eval:
            stale = heapq.heappop(self._q.results)
            self.staleness.on_rollout_dropped()
            dropped.append(stale.oldest)
            again = self._rerun_stale_locked(stale)
            logger.warning(
                "dropped a stale trajectory of version %d (version %d, max_staleness=%d, oldest allowed %d)%s",
                stale.oldest,
                self.engine.get_version(),
                self.staleness.max_staleness,
                floor,
                "; its dataloader item runs again" if again else "",
            )
            true = torch.ones(1, dtype=torch.bool)
            with stats_tracker.scope("rollout"):
                stats_tracker.denominator(n_stale_dropped=true, n_stale_rerun=true if again else ~true)
        return dropped

    def _rerun_stale_locked(self, stale: Result) -> bool:
        """Queue a stale trajectory's dataloader item again, first, so no prompt is skipped (a few times at most)."""
        task = stale.task
        if task.task_id not in self._q.pending or task.stale_reruns >= MAX_STALE_RERUNS:
            self._q.pending.pop(stale.task_id, None)
            return False
        task.stale_reruns += 1
        self._q.input.appendleft(task)
        self._runner.thread.wake()
        return True

    def _stale_message(self, wanted: int, can_arrive: int, dropped: list[int]) -> str:
        version = self.engine.get_version()
        return (
            f"wait: {len(dropped)} trajectories were dropped as stale (generated at version(s) "
            f"{sorted(set(dropped))}; at version {version} max_staleness={self.staleness.max_staleness} accepts "
            f"version {self.staleness.min_allowed_version(version)} or newer), so only {can_arrive} of the {wanted} "
            "asked for can still arrive. Call set_version() once per training step, not more, or raise "
            "rollout.max_staleness."
        )

    def _warn_stuck(self, wanted: int, can_arrive: int, waited: float) -> bool:
        """Say why a long wait cannot end by itself, if it cannot (lock held); whether it said so."""
        if can_arrive < wanted:
            logger.warning(
                f"wait has waited {waited:.0f} s for {wanted} trajectories; {can_arrive} are ready, running or "
                "queued, so it ends only when more items are submitted (from another thread). Episodes whose "
                "trajectory should_accept_fn rejected, or that failed on the servers and were dropped, do not "
                "count: ask wait for what was accepted, or submit more"
            )
            return True
        version = self.engine.get_version()
        if self._q.n_running or not self._q.input or self.staleness.budget(version) > 0:
            return False
        logger.warning(
            f"wait has waited {waited:.0f} s for {wanted} trajectories; {len(self._q.results)} are ready and "
            f"{len(self._q.input)} queued, but the staleness budget starts no more episodes at version {version} "
            f"(rollout.max_staleness={self.staleness.max_staleness} admits {self.staleness.consumer_batch_size} "
            "per version, the batch size of initialize(batch_size=...)): it ends only when set_version() moves on "
            "(from another thread). Ask wait for at most the batch size per training step"
        )
        return True

    def _raise_demand(self, count: int) -> None:
        """Let the loop run past the output bound until ``count`` results exist (lock held)."""
        if count > self._q.demand:
            self._q.demand = count
            self._runner.thread.wake()
