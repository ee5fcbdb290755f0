"""The trainer's control calls to the servers, on an event loop of their own over kept-alive connections.

A weight update calls every server of the run (1,024 at 256 servers of TP 4 is the plan's worker
count; the servers themselves are the calls): blocking calls on a thread each cost a thread and a
new TCP connection per call, and calls on the rollout pool's loop wait behind its generation
traffic (its lag was seconds at 256 simulated servers) and slow it down in turn. So the control
calls (pause, resume, sleep, wake, each update's one call per server) run here: one daemon thread
per process running one event loop, with :class:`~megarl.serving.kept_http.KeptConnections` kept alive
between updates (:data:`~megarl.serving.http.CONTROL_KEEPALIVE_S`; the servers megarl starts keep theirs
longer, :data:`~megarl.serving.http.SERVER_KEEPALIVE_S`). :func:`control_loop` returns the process's
(started on first use, anew after a fork).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from megarl.serving.http import CONTROL_KEEPALIVE_S
from megarl.serving.kept_http import KeptConnections

T = TypeVar("T")


class ControlLoop:
    """An event loop in a daemon thread and its connections to the servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._connections: KeptConnections | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(started,), daemon=True, name="megarl-control-loop")
        self._thread.start()
        started.wait()

    def _main(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        self.loop.run_forever()

    def connections(self) -> KeptConnections:
        """The loop's connections to the servers (call on the loop; no limit on their number)."""
        if self._connections is None:
            self._connections = KeptConnections(max_idle_s=CONTROL_KEEPALIVE_S)
        return self._connections

    def submit(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """Schedule ``coro`` on the loop; a concurrent future of its result (for any thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's own)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("ControlLoop.run called on the control loop itself (would wait forever)")
        return self.submit(coro).result(timeout)


_lock = threading.Lock()
_loop: ControlLoop | None = None
_pid = 0


def control_loop() -> ControlLoop:
    """This process's control loop (started on first use; a forked child starts its own)."""
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid():
            _loop, _pid = ControlLoop(), os.getpid()
        return _loop
