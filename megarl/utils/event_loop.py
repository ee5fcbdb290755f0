"""Event loops whose turns stay short when many sockets become readable at once.

asyncio's selector loop runs, in each turn, the callback of every socket the selector found ready,
then every coroutine those callbacks woke: a burst of replies (a weight update pauses every server
and each aborts its requests in flight: 2,048 replies at once at 256 servers) is one turn of
hundreds of milliseconds, and every timer of the loop (deadlines, sleeps) waits for its end. A loop
from :func:`new_bounded_event_loop` takes at most ``max_events`` ready sockets per turn; epoll reports
the others at the next turn (asyncio polls level-triggered, and epoll hands back the ready sockets
round-robin, so none waits behind the others for more than a few turns).
"""

from __future__ import annotations

import asyncio
import selectors

MAX_EVENTS_PER_TURN = 64
"""Ready sockets one turn of a bounded loop handles (each a reply or part of one: tens of microseconds
of parsing, and the coroutine it wakes about a millisecond at most), so a turn lasts milliseconds."""


class _CappedEpoll:
    """An ``epoll`` object whose :meth:`poll` returns at most ``cap`` events (the rest stay ready)."""

    def __init__(self, epoll, cap: int):
        self._epoll, self._cap = epoll, cap

    def poll(self, timeout: float = -1, maxevents: int = -1):
        return self._epoll.poll(timeout, self._cap if maxevents <= 0 else min(maxevents, self._cap))

    def __getattr__(self, name: str):
        return getattr(self._epoll, name)


def new_bounded_event_loop(max_events: int = MAX_EVENTS_PER_TURN) -> asyncio.AbstractEventLoop:
    """A new event loop that handles at most ``max_events`` ready sockets per turn (where the platform
    has epoll; elsewhere asyncio's default loop)."""
    if max_events < 1:
        raise ValueError(f"max_events must be >= 1, got {max_events}")
    if not hasattr(selectors, "EpollSelector"):
        return asyncio.new_event_loop()
    selector = selectors.EpollSelector()
    selector._selector = _CappedEpoll(selector._selector, max_events)  # select() polls through it
    return asyncio.SelectorEventLoop(selector)
