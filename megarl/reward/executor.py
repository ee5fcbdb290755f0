"""Run reward functions in worker processes, with a timeout, from asyncio code.

Rewards can be slow (sympy) or hang (pathological expressions), and they must not
block the rollout event loop. :class:`AsyncRewardWrapper` sends each call to a
``ProcessPoolExecutor`` started with ``spawn`` (forking a process that runs an event
loop thread and holds sockets is unsafe) and waits at most ``timeout_seconds``. Inside
the workers a task runs on the process's main thread, so math-verify's own signal-based
timeouts work there too.

An ``async def`` reward (one that waits on a reward service or an LLM judge: :mod:`megarl.reward.remote`,
:mod:`megarl.reward.judge`) is awaited on the caller's event loop instead, under the same timeout and
the same failure rules: no worker process, so thousands of calls can wait side by side.

Spawned workers import the parent's main module, so a training script must guard its
entry point with ``if __name__ == "__main__":`` (as with any spawn-based pool); without
it, the first reward call fails with multiprocessing's "bootstrapping phase" error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import multiprocessing
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from megarl.api import context as workflow_context
from megarl.config.rollout import RewardConfig
from megarl.reward.base import ScoredReward
from megarl.reward.call import LOGGED_PREFIX, TrainerState, episode_trainer_state, reward_call
from megarl.reward.failures import RewardFailure, RewardFailures, as_reward, describe_call
from megarl.utils import stats_tracker
from megarl.utils.heartbeat import InFlight
from megarl.utils.keeper import exit_with_parent

logger = logging.getLogger(__name__)


class _RewardTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise _RewardTimeout


def call_reward(
    reward_fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float, trainer_state: TrainerState
) -> tuple[ScoredReward | RewardFailure, dict[str, list[float]]]:
    """Worker side: call ``reward_fn`` under a ``timeout`` alarm at ``trainer_state``; a reward, or what
    went wrong (never raises), and the numbers it logged (:mod:`megarl.reward.call`). The config check
    makes the same call in its own process.

    The clock starts when the worker starts the call, so a cold pool (spawned workers
    importing the trainer's modules, seconds on a busy machine) costs no reward.
    """
    with reward_call(trainer_state) as call, _alarm_after(timeout):
        try:
            value = reward_fn(*args, **kwargs)
        except _RewardTimeout:
            return RewardFailure("timeout"), dict(call.logged)
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's code (sys.exit too): reported with its traceback
            trace = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            return RewardFailure("raised", trace), dict(call.logged)
    return as_reward(value), dict(call.logged)


@contextlib.contextmanager
def _alarm_after(timeout: float) -> Iterator[None]:
    """``_RewardTimeout`` in the block after ``timeout`` seconds (no alarm off the main thread: signals
    reach only the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def is_async_reward(reward_fn: Callable[..., Any]) -> bool:
    """``reward_fn`` is an ``async def`` (or an object whose ``__call__`` is one): it is awaited on the
    caller's event loop, not sent to a worker process."""
    return inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(getattr(reward_fn, "__call__", None))


async def call_reward_async(
    reward_fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float, trainer_state: TrainerState
) -> tuple[ScoredReward | RewardFailure, dict[str, list[float]]]:
    """:func:`call_reward` for an ``async def`` reward, on the caller's event loop: awaited for at most
    ``timeout`` seconds (then cancelled). A ``TimeoutError`` of the reward's own (an HTTP client's, say) is
    an exception it raised, reported with its traceback; only the bound's expiry is a timeout."""
    with reward_call(trainer_state) as call:
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                value = await reward_fn(*args, **kwargs)
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's code, as in call_reward
            if isinstance(e, TimeoutError) and deadline.expired():
                return RewardFailure("timeout"), dict(call.logged)
            trace = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            return RewardFailure("raised", trace), dict(call.logged)
    return as_reward(value), dict(call.logged)


def _import_reward(reward_fn: Callable[..., Any]) -> None:
    """Worker side of ``warm_up``: unpickling ``reward_fn`` imported its module; nothing else to do."""


class AsyncRewardWrapper:
    """``await wrapper(*args, **kwargs)`` runs ``reward_fn`` in a process pool (an ``async def`` one: awaited
    on the caller's event loop).

    A call that exceeds ``timeout_seconds``, crashes its worker or raises scores 0 (a failed call);
    :class:`~megarl.reward.failures.RewardFunctionError` is raised when the function is broken: each of
    its first calls failed, more than ``max_error_fraction`` of the last ``error_window`` did, or it
    returned something that is not a finite number (:mod:`megarl.reward.failures`). Every call records
    ``reward/n_calls`` and ``reward/<outcome>`` counts (and ``reward/failures`` for parse failures,
    errors and timeouts) to ``stats_tracker`` in the caller's scope.

    Args:
        reward_fn: A picklable (module-level) function returning a float or a ScoredReward, or an
            ``async def`` one.
        timeout_seconds: Bound on one call once a worker runs it (a SIGALRM in the worker; an
            ``async def`` reward is cancelled).
        max_workers: Worker processes (default: CPU count, at most 8).
        startup_grace_seconds: Extra wait for a free, started worker (spawn imports the
            trainer's modules); past ``timeout_seconds`` plus this the call scores 0 and
            the pool is replaced (a worker stuck where the alarm cannot reach it).
        max_error_fraction: Share of the last ``error_window`` calls that may fail before the
            function counts as broken (``reward.max_error_fraction``).
        error_window: How many recent calls that share is taken over (``reward.error_window``).
        kwargs: Keyword arguments every call gets beside the row's fields (``reward.kwargs``: a reward
            service's address, a judge's model), taking precedence over a row field of the same name.
    """

    FAILURE_OUTCOMES = ("no_answer", "bad_reference", "error", "timeout")

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        timeout_seconds: float = 15.0,
        max_workers: int | None = None,
        startup_grace_seconds: float = 300.0,
        max_error_fraction: float = 0.5,
        error_window: int = 64,
        kwargs: dict[str, Any] | None = None,
    ):
        if timeout_seconds <= 0:
            raise ValueError(f"AsyncRewardWrapper: timeout_seconds must be > 0, got {timeout_seconds}")
        self.reward_fn = reward_fn
        self.is_async = is_async_reward(reward_fn)
        self.kwargs = dict(kwargs or {})
        self.name = f"{getattr(reward_fn, '__module__', '?')}.{getattr(reward_fn, '__qualname__', repr(reward_fn))}"
        self.failures = RewardFailures(self.name, timeout_seconds, max_error_fraction, error_window)
        self.timeout_seconds = timeout_seconds
        self.startup_grace_seconds = startup_grace_seconds
        self.max_workers = max_workers or min(8, multiprocessing.cpu_count())
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(
        cls, reward_fn: Callable[..., Any], config: RewardConfig | None = None, max_workers: int | None = None
    ) -> AsyncRewardWrapper:
        """A wrapper of ``reward_fn`` as the ``reward`` section says (None: its defaults)."""
        config = config or RewardConfig()
        return cls(
            reward_fn,
            config.timeout_seconds,
            max_workers,
            max_error_fraction=config.max_error_fraction,
            error_window=config.error_window,
            kwargs=config.kwargs,
        )

    def _get_executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                ctx = multiprocessing.get_context("spawn")
                self._executor = concurrent.futures.ProcessPoolExecutor(
                    self.max_workers, mp_context=ctx, initializer=exit_with_parent
                )
            return self._executor

    def warm_up(self) -> list[concurrent.futures.Future]:
        """Start every worker now, not at the first call: each spawned worker imports the
        trainer's and the reward's modules, seconds of CPU that would otherwise delay the
        first step's rewards (and slow the servers decoding beside them). Returns the imports'
        futures (for whoever wants to wait for them); none for an ``async def`` reward, which needs no worker."""
        if self.is_async:
            return []
        executor = self._get_executor()
        # a submit with no idle worker spawns one
        return [executor.submit(_import_reward, self.reward_fn) for _ in range(self.max_workers)]

    def _replace_executor(self, broken: concurrent.futures.ProcessPoolExecutor) -> None:
        """Drop ``broken`` (hung or crashed); the next call starts a fresh pool.

        A hung worker is not killed: calls still running in the old pool may finish,
        and it exits once its task returns (math-verify's own timeout ends most hangs).
        """
        with self._lock:
            if self._executor is broken:
                self._executor = None
        broken.shutdown(wait=False, cancel_futures=False)

    async def __call__(self, *args: Any, **kwargs: Any) -> ScoredReward:
        with _REWARD_CALLS.track(self.name, workflow_context.get().task_id):
            result, logged = await self._score(*args, **{**kwargs, **self.kwargs})
        _record_logged(logged)
        reward = self.failures.record(result, describe_call(args, kwargs))  # raises when the function is broken
        self._record(reward.outcome)
        return reward

    async def _score(self, *args: Any, **kwargs: Any) -> tuple[ScoredReward | RewardFailure, dict[str, list[float]]]:
        state = episode_trainer_state()
        if self.is_async:
            return await call_reward_async(self.reward_fn, args, kwargs, self.timeout_seconds, state)
        executor = self._get_executor()
        call = functools.partial(call_reward, self.reward_fn, args, kwargs, self.timeout_seconds, state)
        try:
            future = asyncio.get_running_loop().run_in_executor(executor, call)
            return await asyncio.wait_for(future, self.timeout_seconds + self.startup_grace_seconds)
        except TimeoutError:
            logger.warning(
                "reward %s got no answer from its worker within %.0fs; scoring 0, replacing the pool",
                self.name,
                self.timeout_seconds + self.startup_grace_seconds,
            )
            self._replace_executor(executor)
            return RewardFailure("timeout"), {}
        except BrokenProcessPool as e:
            logger.warning("reward worker died (%s); scoring 0", e)
            self._replace_executor(executor)
            return RewardFailure("crashed", str(e)), {}

    def _record(self, outcome: str) -> None:
        true = torch.ones(1, dtype=torch.bool)
        counts = {"reward/n_calls": true, f"reward/{outcome}": true}
        if outcome in self.FAILURE_OUTCOMES:
            counts["reward/failures"] = true
        stats_tracker.denominator(**counts)

    def close(self) -> None:
        """Shut the worker processes down (waits for running calls)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def __getstate__(self):
        raise TypeError("AsyncRewardWrapper holds a process pool and cannot be pickled")


def _record_logged(logged: dict[str, list[float]]) -> None:
    """What a reward call logged, in the caller's stats scope: each value under ``reward/logged/<name>``."""
    for name, values in logged.items():
        for value in values:
            stats_tracker.scalar(**{LOGGED_PREFIX + name: value})


_REWARD_CALLS = InFlight("reward call(s) running")  # of this process, by reward function


def describe_in_flight() -> str:
    """The reward calls running now, oldest first (the watchdog's view of an episode waiting for its reward)."""
    return _REWARD_CALLS.describe()
