"""The rollout pool (AReaL's ``WorkflowExecutor``): episodes on an asyncio loop in a thread.

The training thread calls ``submit / wait / rollout_batch / prepare_batch``; a
background thread runs an event loop that starts queued episodes while the
:class:`StalenessManager` allows, runs each ``workflow.arun_episode(engine, data)`` as a
task, filters the results (None or ``should_accept_fn`` false → rejected) and keeps the
accepted ones until ``wait`` hands them out, oldest weights first.

Back-pressure instead of errors: ``submit`` blocks while the input queue is full, and
no episode starts while accepted-but-unconsumed plus running episodes fill the output
bound. Trajectories holding a token older than ``version - max_staleness`` are dropped
at hand-off (see :mod:`megarl.rollout.staleness`).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.api.engine_api import InferenceEngine
from megarl.api.trajectory import batch_size_of, concat_padded_tensors, oldest_version
from megarl.api.workflow_api import RolloutWorkflow, WorkflowLike
from megarl.config.rollout import InferenceEngineConfig
from megarl.rollout.staleness import StalenessManager
from megarl.utils import stats_tracker
from megarl.workflow import context as workflow_context
from megarl.workflow.dump import TrajectoryDumper
from megarl.workflow.resolve import resolve_workflow

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # prepare_batch re-checks whether to feed more data at least this often


class RolloutError(RuntimeError):
    """A workflow raised; the original exception is chained."""


@dataclass
class _Task:
    task_id: int
    data: dict[str, Any]
    workflow: RolloutWorkflow
    should_accept_fn: Callable[[dict[str, Any]], bool] | None
    is_eval: bool
    watch: bool = False  # rollout_batch waits for this very task


@dataclass(order=True)
class _Result:
    oldest: int  # oldest token version: hand-off order and staleness check
    seq: int
    task_id: int = field(compare=False)
    traj: dict[str, Any] = field(compare=False)
    is_eval: bool = field(compare=False)
    n_tokens: int = field(compare=False)


class RolloutPool:
    """Runs episodes concurrently and collects accepted trajectories into batches.

    Args:
        engine: What workflows call ``agenerate`` on; its ``get_version()`` is the version.
        config: Concurrency, staleness and queue bounds.
        batch_size: Trajectories the trainer consumes per step (the staleness unit).
        dumper: Writes every trajectory to JSONL when given.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        config: InferenceEngineConfig,
        batch_size: int,
        dumper: TrajectoryDumper | None = None,
    ):
        self.engine = engine
        self.max_concurrent = config.max_concurrent_rollouts or batch_size
        self.queue_size = config.queue_size or 4 * max(self.max_concurrent, batch_size)
        if self.queue_size < batch_size:
            raise ValueError(
                f"rollout.queue_size={self.queue_size} is smaller than the batch size {batch_size}: "
                "prepare_batch could never queue a whole batch"
            )
        self.staleness = StalenessManager(self.max_concurrent, batch_size, config.max_staleness)
        self.dumper = dumper
        self._cond = threading.Condition()
        self._input: collections.deque[_Task] = collections.deque()
        self._results: list[_Result] = []  # heap
        self._errors: list[RolloutError] = []
        self._watched_done: set[int] = set()
        self._demand = 0  # results a blocked consumer needs: the output bound never starves it
        self._n_running = 0
        self._paused = False
        self._stopping = False
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._data_iter: Iterator | None = None
        self._pending: dict[int, dict[str, Any]] = {}  # fed from the dataloader, not yet handed to the trainer
        self._data_source: Any = None
        self._last_batch_time: float | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RolloutPool:
        """Start the event-loop thread."""
        if self._thread is not None:
            raise RuntimeError("RolloutPool already started")
        started = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(started,), name="megarl-rollout", daemon=True)
        self._thread.start()
        started.wait()
        return self

    def destroy(self, timeout: float = 30.0) -> None:
        """Cancel running episodes and stop the thread."""
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._wake_loop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("rollout thread did not stop within %.0fs", timeout)
        self._thread = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The pool's event loop while it runs (engines run control calls on it)."""
        return self._loop

    def _thread_main(self, started: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._wake = asyncio.Event()
        started.set()
        try:
            loop.run_until_complete(self._run())
        finally:
            self._loop = None
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _wake_loop(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass  # loop closed meanwhile

    async def _run(self) -> None:
        running: set[asyncio.Task] = set()
        while not self._stopping:
            self._wake.clear()  # before launching: a wake-up during launch is not lost
            self._launch_ready(running)
            waiter = asyncio.ensure_future(self._wake.wait())
            done, _ = await asyncio.wait(running | {waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            running -= done
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        aclose = getattr(self.engine, "aclose", None)
        if aclose is not None:
            await aclose()

    # ------------------------------------------------------------------ the loop side

    def _next_launchable(self) -> _Task | None:
        """The oldest queued task that may start now (lock held).

        Training tasks start in order, within the staleness budget and while the output
        side has room (``queue_size``, or what a waiting trainer asked for). Evaluation
        tasks are bound by neither: the trainer waits for them before it takes another
        training trajectory, so they pass training tasks that cannot start.
        """
        if self.max_concurrent - self._n_running <= 0:
            return None
        head = self._input[0]
        if head.is_eval or (self.staleness.get_capacity(self.engine.get_version()) > 0 and not self._output_full()):
            return head
        return next((t for t in self._input if t.is_eval), None)

    def _output_full(self) -> bool:
        return len(self._results) + self._n_running >= max(self.queue_size, self._demand)

    def _launch_ready(self, running: set[asyncio.Task]) -> None:
        while True:
            with self._cond:
                if self._paused or not self._input:
                    return
                task = self._next_launchable()
                if task is None:
                    return
                self._input.remove(task)
                self._n_running += 1
                if not task.is_eval:
                    self.staleness.on_rollout_submitted()
                self._cond.notify_all()  # a blocked submit may proceed
            running.add(asyncio.get_running_loop().create_task(self._run_task(task)))

    async def _run_task(self, task: _Task) -> None:
        ctx = workflow_context.WorkflowContext(is_eval=task.is_eval, task_id=task.task_id)
        scope = "eval-rollout" if task.is_eval else "rollout"
        traj, error = None, None
        start = time.perf_counter()
        with workflow_context.use(ctx), stats_tracker.scope(scope):
            try:
                traj = await task.workflow.arun_episode(self.engine, task.data)
                accepted = traj is not None and (task.should_accept_fn is None or bool(task.should_accept_fn(traj)))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 -- surfaced to the trainer by wait()
                accepted, error = False, e
            if traj is not None and self.dumper is not None:
                await self._dump(traj, task)
            self._finish(task, traj if accepted else None, error, time.perf_counter() - start)

    async def _dump(self, traj: dict[str, Any], task: _Task) -> None:
        version = self.engine.get_version()
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self.dumper.dump, traj, task.task_id, version, task.is_eval
            )
        except Exception as e:  # noqa: BLE001 -- a debugging aid must not fail the run
            logger.warning("could not dump trajectory of task %d: %r", task.task_id, e)

    def _finish(self, task: _Task, traj: dict[str, Any] | None, error: Exception | None, elapsed: float) -> None:
        true = torch.ones(1, dtype=torch.bool)
        stats_tracker.denominator(n_finished=true, n_accepted=true if traj is not None else ~true)
        stats_tracker.scalar(episode_seconds=elapsed, accepted=float(traj is not None))
        with self._cond:
            self._n_running -= 1
            if error is not None:
                err = RolloutError(
                    f"workflow {type(task.workflow).__qualname__} failed on task {task.task_id}: {error!r}"
                )
                err.__cause__ = error
                self._errors.append(err)
            if traj is None:
                self._pending.pop(task.task_id, None)
                if not task.is_eval:
                    self.staleness.on_rollout_rejected()
            else:
                if not task.is_eval:
                    self.staleness.on_rollout_accepted()
                oldest = oldest_version(traj)
                n_tokens = int(traj["loss_mask"].sum()) if "loss_mask" in traj else 0
                version = self.engine.get_version() if oldest is None else oldest
                heapq.heappush(
                    self._results, _Result(version, next(self._ids), task.task_id, traj, task.is_eval, n_tokens)
                )
            if task.watch:
                self._watched_done.add(task.task_id)
            self._cond.notify_all()

    # ------------------------------------------------------------------ the trainer side

    def submit(
        self,
        data: dict[str, Any],
        workflow: WorkflowLike,
        should_accept_fn: Callable[[dict[str, Any]], bool] | None = None,
        group_size: int = 1,
        workflow_kwargs: dict[str, Any] | None = None,
        is_eval: bool = False,
        timeout: float | None = None,
        _watch: bool = False,
        _track: bool = False,
    ) -> int:
        """Queue one episode; blocks while the input queue is full. Returns its task id.

        Evaluation episodes do not wait for room: the queue bounds the training data fed
        ahead, which may be parked until the trainer's next version (after the evaluation).
        A class or string ``workflow`` is instantiated on every call: pass an instance
        when submitting many items.
        """
        wf = resolve_workflow(workflow, workflow_kwargs, group_size)
        task = _Task(next(self._ids), data, wf, should_accept_fn, is_eval, _watch)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not is_eval and len(self._input) >= self.queue_size and not self._stopping:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"submit: input queue stayed full ({self.queue_size}) for {timeout}s")
                self._cond.wait(remaining)
            self._check_running()
            self._input.append(task)
            if _track:  # a dataloader item: pending until its trajectory reaches the trainer
                self._pending[task.task_id] = data
        self._wake_loop()
        return task.task_id

    def _check_running(self) -> None:
        if self._thread is None or self._stopping:
            raise RuntimeError("RolloutPool is not running: call start() (or engine.initialize()) first")

    def _drop_stale_locked(self) -> list[int]:
        """Discard accepted training trajectories older than the staleness bound allows; their versions."""
        floor = self.staleness.min_allowed_version(self.engine.get_version())
        dropped = []
        while self._results and self._results[0].oldest < floor and not self._results[0].is_eval:
            stale = heapq.heappop(self._results)
            self._pending.pop(stale.task_id, None)
            self.staleness.on_rollout_dropped()
            dropped.append(stale.oldest)
            logger.warning("dropped a stale trajectory of version %d (version %d, max_staleness=%d, oldest allowed %d)",
                           stale.oldest, self.engine.get_version(), self.staleness.max_staleness, floor)  # fmt: skip
            with stats_tracker.scope("rollout"):
                stats_tracker.denominator(n_stale_dropped=torch.ones(1, dtype=torch.bool))
        return dropped

    def _take(
        self, max_count: int, min_count: int, timeout: float | None, fail_on_stale: bool = False
    ) -> list[_Result]:
        """Pop between ``min_count`` and ``max_count`` results, oldest first, or [] on timeout.

        ``fail_on_stale``: raise at once when stale drops leave fewer than ``min_count`` that
        can still arrive (queued, running or ready), rather than wait for the timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        dropped: list[int] = []
        with self._cond:
            try:
                while True:
                    if self._errors:
                        raise self._errors.pop(0)
                    dropped += self._drop_stale_locked()
                    if len(self._results) >= min_count:
                        n = min(max_count, len(self._results))
                        taken = [heapq.heappop(self._results) for _ in range(n)]
                        for result in taken:
                            self._pending.pop(result.task_id, None)
                        return taken
                    can_arrive = len(self._results) + self._n_running + len(self._input)
                    if fail_on_stale and dropped and can_arrive < min_count:
                        raise RolloutError(self._stale_message(min_count, can_arrive, dropped))
                    self._check_running()
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return []
                    self._raise_demand(min_count)
                    self._cond.wait(remaining)
            finally:
                self._demand = 0

    def _stale_message(self, wanted: int, can_arrive: int, dropped: list[int]) -> str:
        version = self.engine.get_version()
        return (
            f"wait: {len(dropped)} trajectories were dropped as stale (generated at version(s) "
            f"{sorted(set(dropped))}; at version {version} max_staleness={self.staleness.max_staleness} accepts "
            f"version {self.staleness.min_allowed_version(version)} or newer), so only {can_arrive} of the {wanted} "
            "asked for can still arrive. Call set_version() once per training step, not more, or raise "
            "rollout.max_staleness."
        )

    def _raise_demand(self, count: int) -> None:
        """Let the loop run past the output bound until ``count`` results exist (lock held)."""
        if count > self._demand:
            self._demand = count
            self._wake_loop()

    def wait(self, count: int, timeout: float | None = None) -> list[dict[str, Any]]:
        """Return ``count`` accepted trajectories, oldest weights first.

        Raises ``TimeoutError`` if they are not there within ``timeout`` seconds (the
        ones that are stay queued), and :class:`RolloutError` if a workflow raised or, at
        once, if trajectories dropped as stale leave fewer than ``count`` that can arrive.
        """
        if count <= 0:
            return []
        results = self._take(count, count, timeout, fail_on_stale=True)
        if not results:
            with self._cond:
                have = len(self._results)
            raise TimeoutError(f"wait: only {have} of {count} trajectories ready after {timeout}s")
        self._record_handoff(results)
        return [r.traj for r in results]

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: WorkflowLike,
        should_accept_fn: Callable[[dict[str, Any]], bool] | None = None,
        group_size: int = 1,
        workflow_kwargs: dict[str, Any] | None = None,
        is_eval: bool = False,
    ) -> dict[str, Any]:
        """Run one episode per item and return its accepted trajectories, concatenated, in item order.

        Rejected episodes are simply missing from the result.
        """
        wf = resolve_workflow(workflow, workflow_kwargs, group_size)
        if not is_eval:
            self._check_budget(len(data))
            with self._cond:
                self._raise_demand(len(self._results) + len(data))  # this batch may exceed the output bound
        ids = [self.submit(item, wf, should_accept_fn, is_eval=is_eval, _watch=True) for item in data]
        with self._cond:
            self._cond.wait_for(
                lambda: all(i in self._watched_done for i in ids) or bool(self._errors) or self._stopping
            )
            self._demand = 0
            for i in ids:
                self._watched_done.discard(i)
            if self._errors:
                raise self._errors.pop(0)
            self._check_running()
            wanted = set(ids)
            mine = [r for r in self._results if r.task_id in wanted]
            self._results = [r for r in self._results if r.task_id not in wanted]
            heapq.heapify(self._results)
        self._record_handoff(mine)
        return concat_padded_tensors([r.traj for r in sorted(mine, key=lambda r: r.task_id)])

    def _check_budget(self, n: int) -> None:
        """Fail fast when ``n`` training episodes can never all start at the current version."""
        version = self.engine.get_version()
        with self._cond:
            queued = sum(not t.is_eval for t in self._input)
        budget = self.staleness.budget(version) - queued
        if n > budget:
            raise ValueError(
                f"rollout_batch: {n} training episodes exceed the staleness budget of {budget} at version "
                f"{version} (max_staleness={self.staleness.max_staleness}, batch_size="
                f"{self.staleness.consumer_batch_size}); call set_version() after each training step, "
                "or pass is_eval=True for evaluation"
            )

    def prepare_batch(
        self,
        dataloader: Iterable[list[dict[str, Any]]],
        workflow: WorkflowLike,
        should_accept_fn: Callable[[dict[str, Any]], bool] | None = None,
        group_size: int = 1,
        workflow_kwargs: dict[str, Any] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """Return exactly ``dataloader.batch_size`` accepted trajectories, concatenated and padded.

        Keeps the input queue fed from ``dataloader`` (cycled over epochs) so rollout
        overlaps with training; rejected episodes are replaced by new data.
        ``progress(n)`` is called with the number gathered so far while it waits.
        """
        batch_size = getattr(dataloader, "batch_size", None)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"prepare_batch: the dataloader needs an int batch_size >= 1, got {batch_size!r}")
        wf = resolve_workflow(workflow, workflow_kwargs, group_size)
        if self._data_source is not dataloader:
            self._data_source, self._data_iter = dataloader, _cycle(dataloader)
        results: list[_Result] = []
        while len(results) < batch_size:
            self._feed(wf, should_accept_fn, batch_size)
            results += self._take(batch_size - len(results), 1, _POLL_S)
            if progress is not None:
                progress(len(results))
        self._record_handoff(results, batch=True)
        return concat_padded_tensors([r.traj for r in results])

    def _feed(self, wf: RolloutWorkflow, should_accept_fn, batch_size: int) -> None:
        """Submit the next dataloader batch if the queue has room and the budget could use it."""
        with self._cond:
            room = len(self._input) + batch_size <= self.queue_size
            wanted = self.staleness.get_capacity(self.engine.get_version()) + batch_size - len(self._input) > 0
        if room and wanted:
            items = next(self._data_iter)
            if not isinstance(items, list):
                raise TypeError(
                    f"prepare_batch: dataloader batches must be lists of dicts (collate_fn=lambda x: x), "
                    f"got {type(items).__name__}"
                )
            for item in items:
                self.submit(item, wf, should_accept_fn, _track=True)

    def pending_items(self) -> list[dict[str, Any]]:
        """Dataloader items taken by ``prepare_batch`` whose trajectories the trainer has not received yet.

        With the dataloader's state they make a recover point exact: resubmit them first
        (:meth:`resubmit`) and no prompt is skipped or repeated.
        """
        with self._cond:
            return [self._pending[task_id] for task_id in sorted(self._pending)]

    def resubmit(
        self, version: int, items: list[dict[str, Any]], workflow: WorkflowLike, should_accept_fn=None
    ) -> None:
        """Resume a recovered run at ``version``: its staleness budget, then ``items`` (the recover
        point's pending items), queued ahead of the dataloader's next batches."""
        self.staleness.on_resumed_at(version)
        wf = resolve_workflow(workflow)
        for item in items:
            self.submit(item, wf, should_accept_fn, _track=True)

    def pause(self) -> None:
        """Start no new episodes (running ones continue)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        """Start episodes again."""
        with self._cond:
            self._paused = False
        self._wake_loop()

    @property
    def idle(self) -> bool:
        """No episode is running: the servers have no work from this pool right now."""
        with self._cond:
            return self._n_running == 0

    def notify_version(self) -> None:
        """The version changed: capacity may have grown."""
        self._wake_loop()

    # ------------------------------------------------------------------ stats

    def _record_handoff(self, results: list[_Result], batch: bool = False) -> None:
        version = self.engine.get_version()
        staleness = torch.tensor([float(version - r.oldest) for r in results if not r.is_eval])
        with stats_tracker.scope("rollout"):
            if staleness.numel():
                mask = torch.ones_like(staleness, dtype=torch.bool)
                stats_tracker.denominator(n_trajectories=mask)
                stats_tracker.stat(staleness=staleness, denominator="n_trajectories")
                for value in staleness.unique().tolist():
                    stats_tracker.denominator(**{f"staleness_hist/{int(value)}": staleness == value})
            with self._cond:
                stats_tracker.scalar(
                    input_queue_depth=len(self._input), output_queue_depth=len(self._results), running=self._n_running
                )
            if batch:
                self._record_throughput(results)

    def _record_throughput(self, results: list[_Result]) -> None:
        now = time.perf_counter()
        if self._last_batch_time is not None:
            elapsed = max(now - self._last_batch_time, 1e-9)
            tokens = sum(r.n_tokens for r in results)
            rows = sum(batch_size_of(r.traj) for r in results)
            stats_tracker.scalar(throughput_tokens_per_s=tokens / elapsed, throughput_trajs_per_s=rows / elapsed)
        self._last_batch_time = now


def _cycle(dataloader: Iterable) -> Iterator:
    """Batches of ``dataloader`` over and over (re-iterating it each epoch, unlike itertools.cycle)."""
    while True:
        empty = True
        for batch in dataloader:
            empty = False
            yield batch
        if empty:
            raise ValueError("prepare_batch: the dataloader yielded no batch")
