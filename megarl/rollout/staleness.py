"""Bound how off-policy rollouts may be (AReaL's ``StalenessManager``).

The trainer consumes ``batch_size`` trajectories per step and bumps the weight version
after each step. Starting an episode at version ``v`` is allowed only while::

    accepted + running < (max_staleness + v + 1) * batch_size

so that, if episodes finished in the order they started, the trajectories of step
``c`` would all have started at version ``c - max_staleness`` or later. Episodes may
finish out of order, and a filter or a workflow may reject them, so the count alone
does not guarantee the bound; the pool enforces it exactly by dropping, at hand-off,
any trajectory holding a token older than ``version - max_staleness`` and returning
its slot here (:meth:`on_rollout_dropped`). ``max_staleness = 0`` is synchronous RL.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutStat:
    """Counters of training episodes: started, accepted, rejected, running, dropped as stale."""

    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    running: int = 0
    dropped: int = 0


class StalenessManager:
    """Capacity for new training episodes under the concurrency and staleness bounds.

    Thread-safe: the pool's event loop reports episode events while the trainer
    thread reads capacity and drops stale trajectories.
    """

    def __init__(self, max_concurrent_rollouts: int, consumer_batch_size: int, max_staleness: int):
        if max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {max_concurrent_rollouts}")
        if consumer_batch_size < 1:
            raise ValueError(f"consumer_batch_size must be >= 1, got {consumer_batch_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.consumer_batch_size = consumer_batch_size
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        self._stat = RolloutStat()

    def get_capacity(self, current_version: int) -> int:
        """Episodes that may start now: ``min(max_concurrent - running, budget - (accepted + running))``."""
        with self._lock:
            concurrency = self.max_concurrent_rollouts - self._stat.running
        return min(concurrency, self.budget(current_version))

    def budget(self, current_version: int) -> int:
        """Episodes the staleness bound alone still admits at ``current_version``."""
        with self._lock:
            s = self._stat
            return (self.max_staleness + current_version + 1) * self.consumer_batch_size - (s.accepted + s.running)

    def min_allowed_version(self, current_version: int) -> int:
        """The oldest token version a trajectory handed to the trainer at ``current_version`` may hold."""
        return current_version - self.max_staleness

    def _update(self, **delta: int) -> None:
        with self._lock:
            s = self._stat
            self._stat = RolloutStat(**{k: getattr(s, k) + delta.get(k, 0) for k in s.__dataclass_fields__})

    def on_rollout_submitted(self) -> None:
        """An episode started."""
        self._update(submitted=1, running=1)

    def on_rollout_accepted(self) -> None:
        """An episode finished and its trajectory was accepted."""
        self._update(accepted=1, running=-1)

    def on_rollout_rejected(self) -> None:
        """An episode finished without a usable trajectory (None, filtered out, failed)."""
        self._update(rejected=1, running=-1)

    def on_rollout_dropped(self) -> None:
        """An accepted trajectory turned out too stale and was discarded: its slot is free again."""
        self._update(accepted=-1, dropped=1)

    def get_stats(self) -> RolloutStat:
        """A snapshot of the counters."""
        with self._lock:
            return self._stat
