"""The trainer's weight-update calls: one kept-alive HTTP/1.1 connection per server, parsed by httptools.

Rank 0 makes one update call per server per update: 1,024 calls at 1,024 servers, each streaming a few
JSON lines back (paused, committed). Through aiohttp a call cost the trainer's process about 0.5 ms of
CPU on a 2-core EPYC (its client machinery in Python per request); a connection that writes one
prebuilt request and hands the reply to httptools' C parser costs about a quarter of that
(``benchmarks/scale_sim.py``'s ``trainer_cpu_s_per_update``). The connections live on the control loop
(:mod:`megarl.serving.control_loop`), one per server, one request at a time, kept open between updates
(the servers megarl starts keep theirs for :data:`~megarl.serving.http.SERVER_KEEPALIVE_S`).

A connection found closed (the server restarted, or closed it idle) is replaced before the request is
written; one that fails after is not retried: the caller cannot know how far the server got.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httptools

from megarl.utils.auth import auth_headers

ERROR_TEXT_LIMIT = 4096
"""How much of a failed (non-200) reply's body is kept for the error message."""


@dataclass
class Reply:
    """A finished request: its status, and for a status other than 200 the start of its body."""

    status: int
    text: str = ""


class _Connection(asyncio.Protocol):
    """One server's connection: a request at a time; each line of a 200 reply goes to ``on_line`` as it comes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.spare = False
        """Opened beside the server's kept one (that one was busy): closed after its reply."""
        self._waiter: asyncio.Future | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._on_line: Callable[[bytes], None] = _ignore
        self._pending = b""  # the start of a line whose end has not come yet
        self._error_body = bytearray()

    @property
    def busy(self) -> bool:
        return self._waiter is not None

    @property
    def closed(self) -> bool:
        """Closed by either side (or closing): no request goes on it again."""
        return self.transport is None or self.transport.is_closing()

    def begin(self, request: bytes, on_line: Callable[[bytes], None]) -> asyncio.Future:
        """Write ``request``; the future of its :class:`Reply`."""
        self._waiter = asyncio.get_running_loop().create_future()
        self._parser = httptools.HttpResponseParser(self)
        self._on_line, self._pending, self._error_body = on_line, b"", bytearray()
        self.transport.write(request)
        return self._waiter

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:  # on_line refused a line: the caller's error
            self._fail(e.__context__ or e)
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"not an HTTP reply: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"the server closed the connection mid-reply{f' ({exc})' if exc else ''}"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        if self._parser.get_status_code() != 200:
            self._error_body += body[: ERROR_TEXT_LIMIT - len(self._error_body)]
            return
        *lines, self._pending = (self._pending + body).split(b"\n")
        for line in lines:
            if line.strip():
                self._on_line(line)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        if status == 200 and self._pending.strip():
            self._on_line(self._pending)
        if self.spare or not self._parser.should_keep_alive():
            self.close()
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(Reply(status, self._error_body.decode(errors="replace") if status != 200 else ""))

    def _fail(self, error: BaseException) -> None:
        self.close()  # the reply's state is unknown: the next request gets a new connection
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _ignore(line: bytes) -> None:
    pass


class ControlConnections:
    """The control loop's connections, one per server address (use on that loop only)."""

    def __init__(self) -> None:
        self._connections: dict[str, _Connection] = {}
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in auth_headers().items()).encode()

    async def post(self, address: str, path: str, body: bytes, on_line: Callable[[bytes], None]) -> Reply:
        """POST the JSON ``body`` to ``http://address/path``; each line of a 200 reply goes to ``on_line``
        as it arrives (an exception it raises ends the request with it). Raises ``OSError`` when the
        server cannot be reached or drops the connection before the reply's end. Cancelled, the
        connection is closed (its reply may still come)."""
        connection = await self._connection(address)
        head = f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        request = head.encode() + self._headers + b"\r\n" + body
        try:
            return await connection.begin(request, on_line)
        except asyncio.CancelledError:
            connection.close()
            raise

    async def _connection(self, address: str) -> _Connection:
        """The server's kept connection, a new one if it is closed, a spare one while it is busy."""
        kept = self._connections.get(address)
        if kept is not None and not kept.closed and not kept.busy:
            return kept
        host, port = address.rsplit(":", 1)
        _, connection = await asyncio.get_running_loop().create_connection(_Connection, host.strip("[]"), int(port))
        if kept is not None and kept.busy and not kept.closed:
            connection.spare = True
        else:
            self._connections[address] = connection
        return connection

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
