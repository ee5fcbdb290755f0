"""An asyncio event loop in a thread of its own, woken from other threads (the rollout pool's engine room)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from megarl.utils.event_loop import new_bounded_event_loop

logger = logging.getLogger(__name__)


class LoopThread:
    """Runs ``main()`` on a new event loop in a daemon thread; other threads wake it with :meth:`wake`.

    Args:
        name: The thread's name (shows in stack dumps).
    """

    def __init__(self, name: str):
        self.name = name
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._done: set[asyncio.Task] = set()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop while ``main()`` runs, else None."""
        return self._loop

    def start(self, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start the thread; returns once its loop exists (``main()`` is running or about to)."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: already started")
        started = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(main, started), name=self.name, daemon=True)
        self._thread.start()
        started.wait()

    def join(self, timeout: float) -> None:
        """Wait for ``main()`` to return (it must have been told to: :meth:`wake` it after setting its flag)."""
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("%s thread did not stop within %.0fs", self.name, timeout)
        self._thread = None

    def wake(self) -> None:
        """Wake a :meth:`wait` of the loop (from any thread; a wake-up before the wait is kept)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass  # loop closed meanwhile

    def arm(self) -> None:
        """Forget earlier wake-ups (on the loop, before looking at the state that a wake-up announces)."""
        self._wake.clear()

    def watch(self, task: asyncio.Task) -> asyncio.Task:
        """On the loop: have ``task``'s end wake :meth:`wait` (and be among what it returns); returns ``task``."""
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self._done.add(task)
        self._wake.set()

    async def wait(self) -> set[asyncio.Task]:
        """On the loop: until a task given to :meth:`watch` finishes or :meth:`wake` is called since :meth:`arm`;
        the tasks that finished since the last call. Each task's end costs O(1): waiting with
        ``asyncio.wait`` on every running task instead added and removed a callback on each of them
        at every wake-up, O(running) per finished episode (the pool's loop then spent most of its
        time there with thousands of episodes in flight)."""
        if not self._done:
            await self._wake.wait()
        done, self._done = self._done, set()
        return done

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on the loop (from any thread)."""
        if self._loop is None:
            raise RuntimeError(f"{self.name}: not running (start() first)")
        self._loop.call_soon_threadsafe(fn)

    def _main(self, main: Callable[[], Coroutine[Any, Any, None]], started: threading.Event) -> None:
        loop = new_bounded_event_loop()  # a burst of replies is spread over turns: timers stay on time
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._wake = asyncio.Event()
        started.set()
        try:
            loop.run_until_complete(main())
        finally:
            self._loop = None
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
