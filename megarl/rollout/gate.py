"""A gate that threads open and close and coroutines wait at without polling (generation across a pause)."""

from __future__ import annotations

import asyncio
import collections
import threading

RELEASE_PER_TURN = 32
"""Waiters let through per turn of their event loop when the gate opens: each goes on to send its
request (about a millisecond of the loop's CPU), so the loop's timers and replies wait for one batch,
not for every paused episode of the pool (2,048 at 256 servers, seconds of work)."""


class Gate:
    """Open or closed, set from any thread; coroutines on any event loop wait for it to open.

    A waiter costs nothing while the gate stays closed: a future on its loop, set when the gate opens
    (polling instead, every paused episode woke 20 times a second: at 2,048 episodes that was most of
    the rollout loop's CPU during a weight update). Opening lets the waiters through oldest first,
    :data:`RELEASE_PER_TURN` per turn of their loop. A gate that is :meth:`released` never holds
    anyone again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True
        self._released = False
        self._waiters: dict[asyncio.AbstractEventLoop, collections.deque[asyncio.Future]] = {}

    @property
    def closed(self) -> bool:
        return not self._open

    @property
    def released(self) -> bool:
        return self._released

    def close(self) -> None:
        with self._lock:
            self._open = False

    def open(self) -> None:
        with self._lock:
            self._open = True
            self._wake_locked()

    def release(self) -> None:
        """Let every waiter through, now and later, whether the gate is open or closed."""
        with self._lock:
            self._released = True
            self._wake_locked()

    async def wait(self) -> None:
        """Return once the gate is open or released (at once if it is)."""
        while True:
            with self._lock:
                if self._open or self._released:
                    return
                loop = asyncio.get_running_loop()
                waiter = loop.create_future()
                self._waiters.setdefault(loop, collections.deque()).append(waiter)
            await waiter  # let through while the gate may have closed again: look again

    def _wake_locked(self) -> None:
        waiters, self._waiters = self._waiters, {}
        for loop, futures in waiters.items():
            if loop.is_closed():
                continue
            try:
                loop.call_soon_threadsafe(_let_through, loop, futures)
            except RuntimeError:
                pass  # the loop closed meanwhile: nobody waits on it


def _let_through(loop: asyncio.AbstractEventLoop, futures: collections.deque[asyncio.Future]) -> None:
    """Wake the next :data:`RELEASE_PER_TURN` of ``futures`` (on their loop), the rest on the loop's next turn."""
    for _ in range(min(RELEASE_PER_TURN, len(futures))):
        future = futures.popleft()
        if not future.done():  # a cancelled waiter
            future.set_result(None)
    if futures:
        loop.call_soon(_let_through, loop, futures)
