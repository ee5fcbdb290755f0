"""A gate that threads open and close and coroutines wait at without polling (generation across a pause)."""

from __future__ import annotations

import asyncio
import threading


class Gate:
    """Open or closed, set from any thread; coroutines on any event loop wait for it to open.

    A waiter costs nothing while the gate stays closed: one event per loop, set once when the gate
    opens (polling instead, every paused episode woke 20 times a second: at 2,048 episodes that was
    most of the rollout loop's CPU during a weight update). A gate that is :meth:`released` never
    holds anyone again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True
        self._released = False
        self._waiters: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}

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
                event = self._waiters.get(loop)
                if event is None:
                    event = self._waiters[loop] = asyncio.Event()
            await event.wait()

    def _wake_locked(self) -> None:
        waiters, self._waiters = self._waiters, {}
        for loop, event in waiters.items():
            if loop.is_closed():
                continue
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass  # the loop closed meanwhile: nobody waits on it
