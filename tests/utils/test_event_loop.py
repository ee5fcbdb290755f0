"""A bounded event loop spreads a burst of readable sockets over turns, and loses none of them."""

import asyncio
import socket

import pytest

from megarl.utils.event_loop import new_bounded_event_loop

SOCKETS = 200


def _turns_of_a_burst(loop: asyncio.AbstractEventLoop) -> list[int]:
    """The loop's turn in which each of :data:`SOCKETS` sockets, all readable at once, was handled."""
    pairs = [socket.socketpair() for _ in range(SOCKETS)]
    turn, seen = [0], []

    def count_turns() -> None:  # runs once per turn of the loop
        turn[0] += 1
        if len(seen) < SOCKETS:
            loop.call_soon(count_turns)
        else:
            loop.stop()

    def on_readable(sock: socket.socket) -> None:
        sock.recv(16)
        loop.remove_reader(sock)
        seen.append(turn[0])

    try:
        for mine, _ in pairs:
            loop.add_reader(mine, on_readable, mine)
        for _, theirs in pairs:
            theirs.send(b"x")
        loop.call_soon(count_turns)
        loop.run_forever()
    finally:
        loop.close()
        for a, b in pairs:
            a.close()
            b.close()
    return seen


def test_a_burst_of_readable_sockets_is_spread_over_turns_and_none_is_lost():
    turns = _turns_of_a_burst(new_bounded_event_loop(max_events=64))
    assert len(turns) == SOCKETS
    per_turn = [turns.count(t) for t in set(turns)]
    assert max(per_turn) <= 64
    assert len(set(turns)) >= SOCKETS // 64  # 200 sockets: at least 4 turns


def test_asyncio_s_own_loop_takes_the_whole_burst_in_one_turn():
    """What the bound is for: the default loop handles every ready socket in one turn."""
    turns = _turns_of_a_burst(asyncio.new_event_loop())
    assert len(set(turns)) == 1


def test_a_bounded_loop_runs_coroutines_and_sockets_as_usual():
    loop = new_bounded_event_loop(max_events=1)

    async def echo() -> bytes:
        server = await asyncio.start_server(lambda r, w: w.write(b"pong"), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = await reader.read(4)
        writer.close()
        server.close()
        return data

    try:
        assert loop.run_until_complete(echo()) == b"pong"
    finally:
        loop.close()


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="max_events must be >= 1, got 0"):
        new_bounded_event_loop(0)
