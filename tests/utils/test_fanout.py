"""Blocking calls to many servers at once, on threads kept between fan-outs."""

from __future__ import annotations

import threading
import time

from megarl.utils import fanout

N = 64


def _calls(barrier: threading.Barrier) -> dict[str, object]:
    return {f"server-{i}": (lambda i=i: barrier.wait() or i) for i in range(N)}


def test_every_call_runs_at_once():
    barrier = threading.Barrier(N, timeout=20)  # breaks unless all N calls wait at the same time
    assert fanout.call_all(_calls(barrier), timeout=30) == {}
    futures = fanout.submit_all({"a": lambda: 1, "b": lambda: 2})
    assert {name: f.result(timeout=10) for name, f in futures.items()} == {"a": 1, "b": 2}


def test_a_fan_out_starts_no_thread_once_the_pool_has_them(monkeypatch):
    fanout.call_all(_calls(threading.Barrier(N, timeout=20)), timeout=30)
    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or real_start(self))
    assert fanout.call_all(_calls(threading.Barrier(N, timeout=20)), timeout=30) == {}
    assert started == [], f"{len(started)} threads started for a second fan-out of {N} calls"


def test_errors_and_timeouts_are_named():
    release = threading.Event()

    def fails():
        raise ConnectionError("refused")

    errors = fanout.call_all({"ok": lambda: None, "bad": fails, "hung": release.wait}, timeout=0.5)
    release.set()
    assert errors == {"bad": "ConnectionError: refused", "hung": "no answer within 0.5s"}


def test_a_forked_child_gets_threads_of_its_own(monkeypatch):
    fanout.call_all({"a": lambda: None}, timeout=10)
    parent_pool = fanout._executor(1)
    monkeypatch.setattr(fanout.os, "getpid", lambda: -1)  # as a child of fork() sees it
    assert fanout._executor(1) is not parent_pool
    assert fanout.call_all({"a": lambda: None}, timeout=10) == {}


def test_the_pool_grows_for_a_larger_fan_out():
    small = fanout._executor(1)
    size = fanout._pool_size
    bigger = fanout._executor(size + 1)
    assert bigger is not small and fanout._pool_size >= 2 * (size + 1)
    start = time.monotonic()
    assert fanout.call_all(_calls(threading.Barrier(N, timeout=20)), timeout=30) == {}
    assert time.monotonic() - start < 25
