"""An episode of the rollout pool: its task, its result, what happens when it fails, what its hand-off records.

An episode that fails on the servers (a request failed after its retries, no server healthy) is not
an error of the run: :class:`EpisodeFailures` logs and counts it (``rollout/n_failed`` and
``rollout/failed/{kind}``) and lets the pool run it again from scratch up to
``rollout.episode_retries`` times before its item is dropped (``rollout/n_dropped_items``); only
``rollout.max_failed_episodes`` failures in a row end the run. An episode whose server died with a
sample half generated on it (``server_lost``) runs again without using up those retries: the
server's death was no fault of the item's.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.api.trajectory import batch_size_of, oldest_version
from megarl.api.workflow_api import RolloutWorkflow
from megarl.serving.http import InferenceServerError
from megarl.utils import stats_tracker
from megarl.utils.host_tensors import host_list

logger = logging.getLogger("megarl.rollout.pool")  # the pool's log: what users filter on

_TRUE = torch.ones(1, dtype=torch.bool)


class RolloutError(RuntimeError):
    """A workflow raised; the original exception is chained."""


@dataclass
class Task:
    """One queued or running episode."""

    task_id: int
    data: dict[str, Any]
    workflow: RolloutWorkflow
    should_accept_fn: Callable[[dict[str, Any]], bool] | None
    is_eval: bool
    watch: bool = False  # rollout_batch waits for this very task
    attempt: int = 0  # runs that failed on the servers so far
    stale_reruns: int = 0  # runs whose trajectory came too late (dropped as stale)

    @property
    def budgeted(self) -> bool:
        """An asynchronous training episode: bound by the staleness budget and counted in it."""
        return not (self.is_eval or self.watch)


@dataclass(order=True)
class Result:
    """An accepted trajectory, ordered for hand-off by its oldest token version."""

    oldest: int  # oldest token version: hand-off order and staleness check
    seq: int
    task: Task = field(compare=False)
    traj: dict[str, Any] = field(compare=False)
    n_tokens: int = field(compare=False)

    @classmethod
    def of(cls, task: Task, traj: dict[str, Any], seq: int, version: int) -> Result:
        """``traj`` of ``task``; ``version`` stands for its oldest token when it carries no versions."""
        oldest = oldest_version(traj)
        n_tokens = sum(host_list(traj["loss_mask"])) if "loss_mask" in traj else 0
        return cls(version if oldest is None else oldest, seq, task, traj, n_tokens)

    @property
    def task_id(self) -> int:
        return self.task.task_id

    @property
    def is_eval(self) -> bool:
        return self.task.is_eval


def server_failure(error: BaseException | None) -> InferenceServerError | None:
    """The inference-server failure that ended an episode (also when a workflow wrapped it), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, InferenceServerError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class EpisodeFailures:
    """Counts episodes that failed on the servers and decides: run again, drop the item, or end the run.

    Used from the pool's event loop only.

    Args:
        episode_retries: Runs again per item after a failure (``rollout.episode_retries``).
        max_failed_episodes: Failures in a row that end the run (``rollout.max_failed_episodes``).
    """

    def __init__(self, episode_retries: int, max_failed_episodes: int):
        self.episode_retries = episode_retries
        self.max_failed_episodes = max_failed_episodes
        self._in_a_row = 0

    def finished(self, task: Task, failure: InferenceServerError | None) -> tuple[bool, RolloutError | None]:
        """An episode ended (``failure``: on the servers): (run it again?, the run's error once too many failed)."""
        if failure is None:
            self._in_a_row = 0
            return False, None
        stats_tracker.denominator(**{f"failed/{failure.kind}": _TRUE})
        if failure.kind == "server_lost":  # rerun from scratch, the item's retries untouched
            logger.warning(
                "episode of task %d lost its server; running it again from scratch: %s", task.task_id, failure
            )
            return True, None
        task.attempt += 1
        self._in_a_row += 1
        if self._in_a_row > self.max_failed_episodes:
            return False, RolloutError(
                f"{self._in_a_row} episodes in a row failed on the inference servers (rollout.max_failed_episodes="
                f"{self.max_failed_episodes}); the last, task {task.task_id}: {failure}"
            )
        if task.attempt <= self.episode_retries:
            attempts = f"attempt {task.attempt + 1} of {self.episode_retries + 1}"
            logger.warning(
                "episode of task %d failed on the servers (%s); running it again (%s): %s",
                task.task_id,
                failure.kind,
                attempts,
                failure,
            )
            return True, None
        logger.warning(
            "episode of task %d failed on the servers %d times; its item is dropped. The last (%s): %s",
            task.task_id,
            task.attempt,
            failure.kind,
            failure,
        )
        stats_tracker.denominator(n_dropped_items=_TRUE)
        return False, None


class HandoffStats:
    """What a hand-off of trajectories to the trainer records: staleness, queue depths, throughput."""

    def __init__(self):
        self._last_batch_time: float | None = None

    def record(self, results: list[Result], version: int, depths: dict[str, int], batch: bool = False) -> None:
        """``results`` handed over at ``version``; ``depths``: the queues' lengths; ``batch``: a whole training batch."""
        staleness = torch.tensor([float(version - r.oldest) for r in results if not r.is_eval])
        with stats_tracker.scope("rollout"):
            if staleness.numel():
                stats_tracker.denominator(n_trajectories=torch.ones_like(staleness, dtype=torch.bool))
                stats_tracker.stat(staleness=staleness, denominator="n_trajectories")
                for value in staleness.unique().tolist():
                    stats_tracker.denominator(**{f"staleness_hist/{int(value)}": staleness == value})
            stats_tracker.scalar(**depths)
            if batch:
                self._record_throughput(results)

    def _record_throughput(self, results: list[Result]) -> None:
        now = time.perf_counter()
        if self._last_batch_time is not None:
            elapsed = max(now - self._last_batch_time, 1e-9)
            tokens = sum(r.n_tokens for r in results)
            rows = sum(batch_size_of(r.traj) for r in results)
            stats_tracker.scalar(throughput_tokens_per_s=tokens / elapsed, throughput_trajs_per_s=rows / elapsed)
        self._last_batch_time = now


@dataclass
class EpisodeQueues:
    """What the trainer's side of the pool and its event loop share; every field under ``cond``."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    input: collections.deque[Task] = field(default_factory=collections.deque)
    results: list[Result] = field(default_factory=list)  # a heap: oldest version first
    errors: list[RolloutError] = field(default_factory=list)  # workflows' own exceptions, for wait()
    watched: dict[int, Result | RolloutError | None] = field(default_factory=dict)  # rollout_batch outcomes by task id
    abandoned: set[int] = field(default_factory=set)  # rollout_batch episodes whose call failed already
    pending: dict[int, dict[str, Any]] = field(default_factory=dict)  # dataloader items not yet handed to the trainer
    n_running: int = 0
    demand: int = 0  # results a blocked consumer needs: the output bound never starves it
    paused: bool = False  # no new episode starts
    stopping: bool = False
