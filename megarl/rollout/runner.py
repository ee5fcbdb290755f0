"""The rollout pool's event loop: starts queued episodes while the budget allows, runs them, files their outcomes.

It runs in a thread of its own (:class:`~megarl.rollout.loop_thread.LoopThread`) and meets the
trainer's side of the pool only in the :class:`~megarl.rollout.episodes.EpisodeQueues` they share.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Any

import torch

from megarl.api import context as workflow_context
from megarl.api.engine_api import GenerationEngine
from megarl.api.trajectory import batch_size_of
from megarl.reward.failures import check_trajectory_rewards
from megarl.rollout.episodes import EpisodeFailures, EpisodeQueues, Result, RolloutError, Task, logger, server_failure
from megarl.rollout.gate import RELEASE_PER_TURN
from megarl.rollout.loop_thread import LoopThread
from megarl.rollout.staleness import StalenessManager
from megarl.rollout.teacher import TeacherScorer
from megarl.utils import stats_tracker
from megarl.utils.heartbeat import Heartbeat
from megarl.utils.host_tensors import host_tensor
from megarl.workflow.dump import TrajectoryDumper

_YES, _NO = torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)  # an episode's counts (read only)
_EVENT_LOOP_BLOCKED = (
    "its event loop is blocked (a workflow, reward or tool made a synchronous call that has not returned: the "
    "stacks of the trainer process that runs the pool show which), or that process died"
)


class EpisodeRunner:
    """Runs ``workflow.arun_episode(engine, data)`` for queued tasks, at most ``max_concurrent`` at a time.

    Asynchronous training tasks start in order, within the staleness budget and while the output side
    has room (``queue_size``, or what a waiting trainer asked for). Evaluation and ``rollout_batch``
    tasks are bound by neither: their caller waits for them right now, so they pass training tasks
    that cannot start.

    Args:
        engine: What workflows call ``agenerate`` on; its ``get_version()`` is the version.
        queues: Shared with the trainer's side.
        staleness: The budget of asynchronous training episodes.
        max_concurrent: Episodes running at once.
        queue_size: Results kept ready plus episodes running, at most (unless a trainer waits for more).
        failures: Decides what happens to an episode that failed on the servers.
        dumper: Writes every trajectory to JSONL when given.
        teacher: Scores every accepted training trajectory (on-policy distillation) when given.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        queues: EpisodeQueues,
        staleness: StalenessManager,
        max_concurrent: int,
        queue_size: int,
        failures: EpisodeFailures,
        dumper: TrajectoryDumper | None = None,
        teacher: TeacherScorer | None = None,
    ):
        self.engine = engine
        self.q = queues
        self.staleness = staleness
        self.max_concurrent = max_concurrent
        self.queue_size = queue_size
        self.failures = failures
        self.dumper = dumper
        self.teacher = teacher
        self.thread = LoopThread("megarl-rollout")
        self._seq = itertools.count()
        self._heartbeat: Heartbeat | None = None
        self._beat_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.thread.start(self._run)

    def stop(self, timeout: float) -> None:
        """Cancel running episodes and stop the thread (``queues.stopping`` must be set)."""
        self.thread.wake()
        self.thread.join(timeout)
        if self._heartbeat is not None:
            self._heartbeat.close()
            self._heartbeat = None

    def start_heartbeat(self, run_dir, name: str, interval: float) -> None:
        """Keep ``{run_dir}/heartbeat/{name}.json`` beating from the event loop, for the watchdog.

        Beaten by a task of the loop itself, it goes silent when a workflow or reward blocks the
        loop (a synchronous call that never returns), which a thread's beat would not show.
        """
        beat = Heartbeat(
            run_dir, name, interval, watch="silence", thread=False, stacks=False, silent_means=_EVENT_LOOP_BLOCKED
        )
        beat.set_detail_fn(self.describe)
        self._heartbeat = beat.start()
        self.thread.call_soon(
            lambda: setattr(self, "_beat_task", asyncio.get_running_loop().create_task(self._beat(beat)))
        )

    async def _beat(self, beat: Heartbeat) -> None:
        while True:
            with self.q.cond:
                state = "paused" if self.q.paused else "generating" if self.q.n_running else "waiting for work"
            beat.set_phase(state)
            beat.beat()
            await asyncio.sleep(beat.interval)

    def describe(self) -> str:
        """``"3 episode(s) running, 5 queued, 2 result(s) ready; version 4"``, for the heartbeat."""
        with self.q.cond:
            running, queued, ready = self.q.n_running, len(self.q.input), len(self.q.results)
        return f"{running} episode(s) running, {queued} queued, {ready} result(s) ready; version {self.engine.get_version()}"

    async def _run(self) -> None:
        running: set[asyncio.Task] = set()
        while not self.q.stopping:
            self.thread.arm()  # before launching: a wake-up during launch is not lost
            if not self._launch_ready(running):
                await asyncio.sleep(0)  # a turn of the loop: the episodes just started send their requests
                continue
            running -= await self.thread.wait()
        if self._beat_task is not None:
            running.add(self._beat_task)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        aclose = getattr(self.engine, "aclose", None)
        if aclose is not None:
            await aclose()
        if self.teacher is not None:
            await self.teacher.aclose()

    # ------------------------------------------------------------------ starting episodes

    def _next_launchable(self) -> Task | None:
        """The oldest queued task that may start now (lock held)."""
        if self.max_concurrent - self.q.n_running <= 0:
            return None
        head = self.q.input[0]
        if not head.budgeted or (self.staleness.get_capacity(self.engine.get_version()) > 0 and not self.output_full()):
            return head
        return next((t for t in self.q.input if not t.budgeted), None)

    def output_full(self) -> bool:
        """Whether ready results plus running episodes fill the output bound (call under ``q.cond``)."""
        return len(self.q.results) + self.q.n_running >= max(self.queue_size, self.q.demand)

    def _launch_ready(self, running: set[asyncio.Task]) -> bool:
        """Start queued episodes while they may start, :data:`~megarl.rollout.gate.RELEASE_PER_TURN` at
        most (each sends its first request in the loop's next turn: a batch of 2,048 started at once held
        the loop's timers and replies for seconds); False when more could start now."""
        for _ in range(RELEASE_PER_TURN):
            with self.q.cond:
                if self.q.paused or not self.q.input:
                    return True
                task = self._next_launchable()
                if task is None:
                    return True
                self.q.input.remove(task)
                self.q.n_running += 1
                if task.budgeted:
                    self.staleness.on_rollout_submitted()
                self.q.cond.notify_all()  # a blocked submit may proceed
            running.add(self.thread.watch(asyncio.get_running_loop().create_task(self._run_task(task))))
        return False

    # ------------------------------------------------------------------ one episode

    async def _run_task(self, task: Task) -> None:
        ctx = workflow_context.WorkflowContext(
            is_eval=task.is_eval, task_id=task.task_id, version=self.engine.get_version()
        )
        scope = "eval-rollout" if task.is_eval else "rollout"
        traj, error = None, None
        start = time.perf_counter()
        with workflow_context.use(ctx), stats_tracker.scope(scope):
            try:
                traj = await task.workflow.arun_episode(self.engine, task.data)
                check_trajectory_rewards(traj, f"workflow {type(task.workflow).__qualname__} (task {task.task_id})")
                accepted = traj is not None and (task.should_accept_fn is None or bool(task.should_accept_fn(traj)))
                if accepted and self.teacher is not None and not task.is_eval:
                    scoring = time.perf_counter()
                    await self.teacher.score(traj)
                    stats_tracker.scalar(teacher_seconds=time.perf_counter() - scoring)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 -- surfaced to the trainer by wait()
                accepted, error = False, e
            if traj is not None and self.dumper is not None:
                await self._dump(traj, task)
            if accepted:
                self._stamp_server(traj, ctx.servers)
            self._finish(task, traj if accepted else None, error, time.perf_counter() - start)

    def _stamp_server(self, traj: dict[str, Any], servers: list[str]) -> None:
        """``traj["server_index"]``: per row, the index of the server that generated the episode in the
        engine's server list (-1: several servers, or none known), for the per-server train–inference gap."""
        addresses = list(getattr(self.engine, "server_addresses", []))
        index = addresses.index(servers[0]) if len(servers) == 1 and servers[0] in addresses else -1
        if isinstance(traj, dict) and "attention_mask" in traj and "server_index" not in traj:
            traj["server_index"] = host_tensor([index] * batch_size_of(traj), torch.int32)

    async def _dump(self, traj: dict[str, Any], task: Task) -> None:
        version = self.engine.get_version()
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self.dumper.dump, traj, task.task_id, version, task.is_eval
            )
        except Exception as e:  # noqa: BLE001 -- a debugging aid must not fail the run
            logger.warning("could not dump trajectory of task %d: %r", task.task_id, e)

    def _finish(self, task: Task, traj: dict[str, Any] | None, error: Exception | None, elapsed: float) -> None:
        """File an episode's outcome: a result, the workflow's error, a run again, or nothing (rejected, dropped)."""
        failure = server_failure(error)
        stats_tracker.denominator(
            n_finished=_YES,
            n_accepted=_YES if traj is not None else _NO,
            n_failed=_YES if failure is not None else _NO,
        )
        stats_tracker.scalar(episode_seconds=elapsed, accepted=float(traj is not None))
        again, run_error = self.failures.finished(task, failure)
        if failure is not None:
            if again:
                self._requeue(task)
                return
            error = run_error  # None: the item is dropped, the run goes on
        err = None
        if error is not None:
            err = RolloutError(f"workflow {type(task.workflow).__qualname__} failed on task {task.task_id}: {error!r}")
            err.__cause__ = error
        result = None if traj is None else Result.of(task, traj, next(self._seq), self.engine.get_version())
        with self.q.cond:
            self.q.n_running -= 1
            if task.budgeted:
                self.staleness.on_rollout_rejected() if result is None else self.staleness.on_rollout_accepted()
            if task.watch:  # for the rollout_batch call waiting on it, unless that call failed already
                if task.task_id not in self.q.abandoned:
                    self.q.watched[task.task_id] = err or result
                self.q.abandoned.discard(task.task_id)
            else:
                if err is not None:
                    self.q.errors.append(err)
                if result is None:
                    self.q.pending.pop(task.task_id, None)
                else:
                    heapq.heappush(self.q.results, result)
            self.q.cond.notify_all()

    def _requeue(self, task: Task) -> None:
        """Run a failed episode again from scratch, ahead of the queue (nothing of the failed run is kept)."""
        with self.q.cond:
            self.q.n_running -= 1
            if task.budgeted:
                self.staleness.on_rollout_rejected()
            if task.task_id in self.q.abandoned:  # its rollout_batch call failed already: nobody waits for it
                self.q.abandoned.discard(task.task_id)
            else:
                self.q.input.appendleft(task)
            self.q.cond.notify_all()
        self.thread.wake()
