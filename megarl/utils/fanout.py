"""Blocking calls to many servers at once, on threads kept between calls.

The weight update and the consistency probe call every inference server in each phase (begin,
receive, commit, score). A thread started per server per phase made the fan-out's cost grow with
the number of servers on a busy machine: ``Thread.start`` waits for the new thread to run, and
with the rollout loop busy each start waited for the interpreter lock, about 8 ms: two seconds
per phase at 256 servers. Threads kept in one pool start once per process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TypeVar

T = TypeVar("T")

_MIN_THREADS = 16
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_pid = 0


def _executor(n_calls: int) -> ThreadPoolExecutor:
    """The process's fan-out pool, with room for ``n_calls`` at once (grown, never shrunk; a new one
    after a fork, whose threads the child does not have)."""
    global _pool, _pool_size, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid() or _pool_size < n_calls:
            old = _pool if _pool_pid == os.getpid() else None
            # twice what is asked: calls that hang past their timeout keep their thread for a while
            _pool_size = max(_MIN_THREADS, 2 * n_calls, _pool_size)
            _pool, _pool_pid = ThreadPoolExecutor(_pool_size, thread_name_prefix="megarl-fanout"), os.getpid()
            if old is not None:
                old.shutdown(wait=False)  # its threads end once their calls return
        return _pool


def submit_all(calls: dict[str, Callable[[], T]]) -> dict[str, Future[T]]:
    """Start every call of ``{name: fn}`` at once; ``{name: future}`` (the caller goes on meanwhile)."""
    pool = _executor(len(calls))
    return {name: pool.submit(fn) for name, fn in calls.items()}


def call_all(calls: dict[str, Callable[[], object]], timeout: float) -> dict[str, str]:
    """Run ``{name: fn}`` concurrently; ``{name: error}`` of those that raised or did not finish in
    ``timeout`` seconds (those go on in the background; their result is ignored)."""
    futures = submit_all(calls)
    wait_futures(futures.values(), timeout)
    errors = {}
    for name, future in futures.items():
        if not future.done():
            errors[name] = f"no answer within {timeout:g}s"
        elif future.exception() is not None:
            e = future.exception()
            errors[name] = f"{type(e).__name__}: {e}"
    return errors
