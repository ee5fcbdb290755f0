"""The gate generation requests wait at during a pause: opened, closed and released from other threads."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megarl.rollout.gate import RELEASE_PER_TURN, Gate
from megarl.rollout.loop_thread import LoopThread
from tests.rollout.helpers import LoopTurns


@pytest.fixture
def loops():
    """Two event loops in threads of their own (the rollout pool's and another's)."""
    threads = []

    def make(n: int = 2) -> list[asyncio.AbstractEventLoop]:
        for i in range(n):
            stop = threading.Event()

            async def main(stop=stop):
                while not stop.is_set():
                    await asyncio.sleep(0.01)

            thread = LoopThread(f"gate-test-{i}")
            thread.start(main)
            threads.append((thread, stop))
        return [t.loop for t, _ in threads]

    yield make
    for thread, stop in threads:
        stop.set()
        thread.join(5)


def _waiters(gate: Gate, loops, per_loop: int):
    return [asyncio.run_coroutine_threadsafe(gate.wait(), loop) for loop in loops for _ in range(per_loop)]


def test_an_open_gate_holds_nobody(loops):
    (loop,) = loops(1)
    asyncio.run_coroutine_threadsafe(Gate().wait(), loop).result(timeout=5)


def test_opening_lets_every_waiter_on_every_loop_through(loops):
    gate = Gate()
    gate.close()
    waiters = _waiters(gate, loops(2), 50)
    time.sleep(0.2)
    assert gate.closed and not any(w.done() for w in waiters)
    gate.open()
    for w in waiters:
        w.result(timeout=5)


def test_a_gate_closed_again_holds_new_waiters(loops):
    (loop,) = loops(1)
    gate = Gate()
    gate.close()
    first = _waiters(gate, [loop], 3)
    gate.open()
    [w.result(timeout=5) for w in first]
    gate.close()
    second = _waiters(gate, [loop], 3)
    time.sleep(0.2)
    assert not any(w.done() for w in second)
    gate.open()
    [w.result(timeout=5) for w in second]


def test_a_released_gate_lets_everyone_through_even_closed(loops):
    (loop,) = loops(1)
    gate = Gate()
    gate.close()
    held = _waiters(gate, [loop], 5)
    time.sleep(0.1)
    gate.release()
    [w.result(timeout=5) for w in held]
    assert gate.closed and gate.released
    _waiters(gate, [loop], 1)[0].result(timeout=5)  # later waiters pass too


def test_opening_lets_waiters_through_a_batch_per_turn_of_their_loop(loops):
    """2,048 paused episodes do not all resume in one turn of the pool's loop: its timers and replies
    wait for one batch of them, not for every one."""
    (loop,) = loops(1)
    gate = Gate()
    gate.close()
    n = 8 * RELEASE_PER_TURN
    woken_at = []  # the loop's turn in which each waiter went through
    turns = LoopTurns(loop, done=lambda: len(woken_at) == n)

    async def waiter():
        await gate.wait()
        woken_at.append(turns.now)

    async def hold():
        tasks = [asyncio.ensure_future(waiter()) for _ in range(n)]
        await asyncio.sleep(0.1)
        turns.tick()
        gate.open()
        await asyncio.gather(*tasks)

    asyncio.run_coroutine_threadsafe(hold(), loop).result(timeout=10)
    assert len(woken_at) == n
    most = LoopTurns.most_in_one_turn(woken_at)
    assert most <= RELEASE_PER_TURN, f"{most} waiters went through in one turn of the loop"


def test_a_cancelled_waiter_is_skipped(loops):
    (loop,) = loops(1)
    gate = Gate()
    gate.close()
    waiters = _waiters(gate, [loop], 3)
    time.sleep(0.1)
    waiters[1].cancel()
    time.sleep(0.1)
    gate.open()
    waiters[0].result(timeout=5)
    waiters[2].result(timeout=5)
