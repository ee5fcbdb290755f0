"""HTTP/1.1 to the inference servers on kept-alive connections, parsed by httptools.

Two callers send many small requests from one event loop each: a trainer head's rollout pool (its
generation requests: about 270 a second per head at 256 servers of the bundled 128-GPU layout's
rate, far more at 1,024) and rank 0's control loop (one weight-update call per server per update).
Through aiohttp's client a request cost about 1.2 ms of the loop's CPU on a 2-core EPYC, most of it
its machinery in Python; here one prebuilt request is written on a kept connection and the reply is
handed to httptools' C parser (uvicorn's), about 0.6 ms with the JSON decode
(``benchmarks/scale_sim.py``'s ``pool_loop_cpu_ms/request`` and ``trainer_cpu_s_per_update``).

A :class:`KeptConnections` keeps each server's idle connections (one per request that was in flight at
once) and reuses the most recent; one found closed (the server restarted, or closed it idle) is
dropped before a request is written. A request that fails after it was written is not retried here:
the caller knows whether the request can be sent again (:func:`megarl.serving.http.arequest_with_retry`
does for generation; an update call is not). Deadlines are the event loop's clock
(``loop.time()``, which is ``time.monotonic()``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import httptools

from megarl.utils.auth import auth_headers

ERROR_TEXT_LIMIT = 4096
"""How much of a failed (non-200) reply's body is kept when the lines of a 200 reply go to ``on_line``."""


@dataclass
class Reply:
    """A finished request: its status and body (with ``on_line``: only a non-200 reply's, its start)."""

    status: int
    body: bytes = b""

    @property
    def text(self) -> str:
        """The body as text (undecodable bytes replaced: for messages; parse :attr:`body` to check it)."""
        return self.body.decode(errors="replace")


class ReplyTimeout(TimeoutError):
    """No complete reply in time: ``waiting_for`` is ``"headers"`` (the request's deadline passed before
    the reply began) or ``"body"`` (its body did not arrive within ``body_timeout`` of its headers)."""

    def __init__(self, waiting_for: str):
        self.waiting_for = waiting_for
        super().__init__(f"no reply {waiting_for} in time")


class ReplyCutError(ConnectionError):
    """The server closed the connection after its reply began, before the reply's end."""


class _Connection(asyncio.Protocol):
    """One connection: a request at a time; its reply goes to the future :meth:`begin` returns."""

    def __init__(self, pool: KeptConnections, address: str) -> None:
        self.pool, self.address = pool, address
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._on_line: Callable[[bytes], None] | None = None
        self._body: list[bytes] = []
        self._pending = b""  # the start of a line whose end has not come yet
        self._replying = False  # a byte of the reply came
        self._body_timeout: float | None = None
        self._deadline: float | None = None
        self._body_deadline: float | None = None  # set once the headers came, until its timer is

    @property
    def closed(self) -> bool:
        """Closed by either side (or closing): no request goes on it again."""
        return self.transport is None or self.transport.is_closing()

    def begin(
        self,
        request: bytes,
        on_line: Callable[[bytes], None] | None,
        deadline: float | None,
        body_timeout: float | None,
    ) -> asyncio.Future:
        """Write ``request``; the future of its :class:`Reply`."""
        self._waiter = self._loop.create_future()
        self._parser = httptools.HttpResponseParser(self)
        self._on_line, self._body, self._pending, self._replying = on_line, [], b"", False
        self._deadline, self._body_timeout, self._body_deadline = deadline, body_timeout, None
        if deadline is not None:
            self._timer = self._loop.call_at(deadline, self._time_out, "headers")
        self.transport.write(request)
        return self._waiter

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: the connection's state is unknown
            self.close()
            return
        self._replying = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:  # on_line refused a line: the caller's error
            self._fail(e.__context__ or e)
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"not an HTTP reply: {e}"))
        else:
            if self._body_deadline is not None and self._waiter is not None:  # the body goes on in later packets
                self._set_timer(self._body_deadline, "body")
                self._body_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool._forget(self)
        why = f" ({exc})" if exc else ""
        if self._replying:
            self._fail(ReplyCutError(f"the server closed the connection mid-reply{why}"))
        else:
            self._fail(ConnectionError(f"the server closed the connection before replying{why}"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        # the body's clock is set once this packet is parsed, and only if the body goes on past it (most
        # replies come whole in one packet: no timer to set and cancel)
        if self._body_timeout is not None:
            body_deadline = self._loop.time() + self._body_timeout
            if self._deadline is None or body_deadline < self._deadline:
                self._body_deadline = body_deadline

    def on_body(self, body: bytes) -> None:
        if self._on_line is None:
            self._body.append(body)
        elif self._parser.get_status_code() != 200:
            if sum(map(len, self._body)) < ERROR_TEXT_LIMIT:
                self._body.append(body)
        else:
            *lines, self._pending = (self._pending + body).split(b"\n")
            for line in lines:
                if line.strip():
                    self._on_line(line)

    def on_message_complete(self) -> None:
        if self._waiter is None:  # a second reply to one request: the connection's state is unknown
            self.close()
            return
        status = self._parser.get_status_code()
        if self._on_line is not None and status == 200 and self._pending.strip():
            self._on_line(self._pending)
        body = b"".join(self._body)
        if self._on_line is not None:
            body = body[:ERROR_TEXT_LIMIT]
        self._set_timer(None)
        waiter, self._waiter = self._waiter, None
        if self._parser.should_keep_alive():
            self.pool._release(self)
        else:
            self.close()
        if not waiter.done():
            waiter.set_result(Reply(status, body))

    # the request's clock
    def _set_timer(self, when: float | None, waiting_for: str = "") -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if when is None else self._loop.call_at(when, self._time_out, waiting_for)

    def _time_out(self, waiting_for: str) -> None:
        self._timer = None
        self._fail(ReplyTimeout(waiting_for))

    def _fail(self, error: BaseException) -> None:
        self.close()  # the reply's state is unknown: the next request gets a new connection
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def close(self) -> None:
        self._set_timer(None)
        self.pool._forget(self)
        if self.transport is not None:
            self.transport.close()


class KeptConnections:
    """Kept-alive connections to many servers, for one event loop (use on that loop only).

    Args:
        limit: At most this many open connections (0: no limit); a request beyond it closes the longest
            idle connection, or waits for one to close.
        max_idle_s: A connection idle longer is closed rather than reused (below the servers' own
            keep-alive, so that a request is not written on a connection the server is closing).
    """

    def __init__(self, limit: int = 0, max_idle_s: float = 15.0) -> None:
        self.limit, self.max_idle_s = limit, max_idle_s
        self.closed = False
        self._idle: dict[str, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._opening = 0  # connections being opened (they count against the limit)
        self._slot_waiters: deque[asyncio.Future] = deque()
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in auth_headers().items()).encode()

    async def request(
        self,
        address: str,
        path: str,
        body: bytes | None = None,
        *,
        method: str = "POST",
        deadline: float | None = None,
        body_timeout: float | None = None,
        on_line: Callable[[bytes], None] | None = None,
    ) -> Reply:
        """``method`` ``http://address/path`` with the JSON ``body``; its :class:`Reply`.

        ``deadline`` (loop time) bounds the whole request and ``body_timeout`` (seconds) the body once its
        headers came: :class:`ReplyTimeout` past either. With ``on_line``, each line of a 200 reply goes
        to it as it arrives (an exception it raises ends the request with it). Raises ``OSError`` when
        the server cannot be reached or drops the connection (:class:`ReplyCutError` after its reply
        began). Cancelled, the connection is closed (its reply may still come)."""
        if self.closed:
            raise ConnectionError("these connections were closed")
        connection = await self._connection(address)
        head = f"{method} {path} HTTP/1.1\r\nHost: {address}\r\n"
        if body is not None or method == "POST":
            head += f"Content-Type: application/json\r\nContent-Length: {len(body or b'')}\r\n"
        request = head.encode() + self._headers + b"\r\n" + (body or b"")
        try:
            return await connection.begin(request, on_line, deadline, body_timeout)
        except asyncio.CancelledError:
            connection.close()
            raise

    async def _connection(self, address: str) -> _Connection:
        """The server's most recently used idle connection, else a new one."""
        idle, now = self._idle.get(address), asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self.max_idle_s:
                return connection
            connection.close()
        while self.limit and len(self._open) + self._opening >= self.limit:
            if not self._close_longest_idle():
                waiter = asyncio.get_running_loop().create_future()
                self._slot_waiters.append(waiter)
                await waiter
        host, port = address.rsplit(":", 1)
        self._opening += 1
        try:
            _, connection = await asyncio.get_running_loop().create_connection(
                lambda: _Connection(self, address), host.strip("[]"), int(port)
            )
        finally:
            self._opening -= 1
            self._wake_a_waiter()
        if connection.closed:  # closed before it could be used
            raise ConnectionError(f"{address} closed the connection at once")
        self._open.add(connection)
        return connection

    def _close_longest_idle(self) -> bool:
        idle = [c for conns in self._idle.values() for c in conns[:1]]
        if not idle:
            return False
        min(idle, key=lambda c: c.idle_since).close()
        return True

    def _release(self, connection: _Connection) -> None:
        """``connection`` finished a reply and may be reused."""
        if self.closed or self._slot_waiters:  # a request waits for a free slot: this one's
            connection.close()
            return
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(connection.address, []).append(connection)

    def _forget(self, connection: _Connection) -> None:
        """``connection`` is closing: no longer open or idle."""
        if connection not in self._open:
            return
        self._open.discard(connection)
        idle = self._idle.get(connection.address)
        if idle and connection in idle:
            idle.remove(connection)
        self._wake_a_waiter()

    def _wake_a_waiter(self) -> None:
        """A slot may have freed: the longest waiting request checks."""
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def close(self) -> None:
        """Close every connection (a request in flight fails with ``ConnectionError``)."""
        self.closed = True
        for connection in list(self._open):
            connection.close()


class LoopConnections:
    """One :class:`KeptConnections` per event loop (connections are bound to the loop that opened them),
    made on first use there: what a client used from several loops holds.

    Args:
        limit: Each loop's :class:`KeptConnections` limit (0: no limit).
    """

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self._by_loop: dict[asyncio.AbstractEventLoop, KeptConnections] = {}
        self._lock = threading.Lock()

    def here(self) -> KeptConnections:
        """The running event loop's connections (those of loops that ended are dropped)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            connections = self._by_loop.get(loop)
            if connections is None or connections.closed:
                for old in [lp for lp in self._by_loop if lp.is_closed()]:
                    del self._by_loop[old]
                connections = self._by_loop[loop] = KeptConnections(self.limit)
            return connections

    def close_here(self) -> None:
        """Close the running loop's connections."""
        with self._lock:
            connections = self._by_loop.pop(asyncio.get_running_loop(), None)
        if connections is not None:
            connections.close()
