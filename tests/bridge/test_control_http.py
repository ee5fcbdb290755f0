"""The update calls' own connections (megarl.serving.control_http) against a real aiohttp server: lines
as they come, kept-alive connections, a server that closes or restarts, a reply cut short, errors."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from megarl.serving.control_http import ControlConnections


class Server:
    """An aiohttp server on the test's loop; ``peers``: the client's (host, port) of each request."""

    def __init__(self, handler, keepalive_s: float = 75.0):
        self.handler, self.keepalive_s, self.peers = handler, keepalive_s, []

    async def __aenter__(self) -> Server:
        app = web.Application()

        async def route(request):
            self.peers.append(request.transport.get_extra_info("peername"))
            return await self.handler(request)

        app.router.add_post("/update", route)
        self.runner = web.AppRunner(app, keepalive_timeout=self.keepalive_s)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.address = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


async def _lines(request, lines: list[bytes], gap_s: float = 0.0):
    reply = web.StreamResponse()
    reply.enable_chunked_encoding()
    await reply.prepare(request)
    for line in lines:
        await reply.write(line + b"\n")
        await asyncio.sleep(gap_s)
    await reply.write_eof()
    return reply


def test_lines_arrive_as_they_come_and_the_connection_is_kept():
    async def main():
        async def handler(request):
            assert await request.json() == {"v": 1}
            return await _lines(request, [b'{"paused": true}', b'{"version": "1"}'], gap_s=0.05)

        async with Server(handler) as server:
            connections, seen = ControlConnections(), []
            for _ in range(3):
                reply = await connections.post(server.address, "/update", b'{"v": 1}', seen.append)
                assert reply.status == 200
            assert seen == [b'{"paused": true}', b'{"version": "1"}'] * 3
            assert len(set(server.peers)) == 1, "each call opened a connection of its own"
            connections.close()

    asyncio.run(main())


def test_a_connection_the_server_closed_while_idle_is_replaced():
    """The server closes idle connections (keep-alive over, or it restarted): the next call opens a new one."""

    async def main():
        async with Server(lambda r: _lines(r, [b'{"version": "1"}']), keepalive_s=0.1) as server:
            connections, seen = ControlConnections(), []
            await connections.post(server.address, "/update", b"{}", seen.append)
            await asyncio.sleep(0.5)
            reply = await connections.post(server.address, "/update", b"{}", seen.append)
            assert reply.status == 200 and len(seen) == 2 and len(set(server.peers)) == 2
            connections.close()

    asyncio.run(main())


def test_an_error_status_returns_the_start_of_its_body():
    async def main():
        async with Server(lambda r: asyncio.sleep(0, web.Response(status=409, text="busy " * 2000))) as server:
            reply = await ControlConnections().post(server.address, "/update", b"{}", lambda line: None)
            assert reply.status == 409 and reply.text.startswith("busy busy") and len(reply.text) == 4096

    asyncio.run(main())


def test_a_reply_cut_mid_body_fails_and_the_next_call_connects_anew():
    async def main():
        calls = []

        async def handler(request):
            calls.append(1)
            if len(calls) > 1:
                return await _lines(request, [b'{"version": "2"}'])
            reply = web.StreamResponse()
            reply.enable_chunked_encoding()
            await reply.prepare(request)
            await reply.write(b'{"paused": true}\n')
            request.transport.close()  # the server dies after part of the body
            return reply

        async with Server(handler) as server:
            connections, seen = ControlConnections(), []
            with pytest.raises(ConnectionError, match="mid-reply"):
                await connections.post(server.address, "/update", b"{}", seen.append)
            assert seen == [b'{"paused": true}']
            assert (await connections.post(server.address, "/update", b"{}", seen.append)).status == 200
            assert seen[-1] == b'{"version": "2"}'

    asyncio.run(main())


def test_a_line_the_caller_refuses_ends_the_call_with_its_error():
    async def main():
        async with Server(lambda r: _lines(r, [b"not json", b'{"version": "1"}'])) as server:

            def refuse(line: bytes):
                raise ValueError(f"bad line {line!r}")

            with pytest.raises(ValueError, match="bad line b'not json'"):
                await ControlConnections().post(server.address, "/update", b"{}", refuse)

    asyncio.run(main())


def test_calls_to_one_server_at_once_each_get_a_connection():
    async def main():
        async with Server(lambda r: _lines(r, [b'{"version": "1"}'], gap_s=0.1)) as server:
            connections = ControlConnections()
            replies = await asyncio.gather(
                *(connections.post(server.address, "/update", b"{}", lambda line: None) for _ in range(3))
            )
            assert [r.status for r in replies] == [200] * 3 and len(set(server.peers)) == 3
            connections.close()

    asyncio.run(main())


def test_a_cancelled_call_closes_its_connection():
    async def main():
        async with Server(lambda r: _lines(r, [b'{"version": "1"}'], gap_s=5.0)) as server:
            connections = ControlConnections()
            call = asyncio.ensure_future(connections.post(server.address, "/update", b"{}", lambda line: None))
            await asyncio.sleep(0.2)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            kept = connections._connections[server.address]
            assert kept.closed

    asyncio.run(main())


def test_a_server_that_does_not_listen_raises_oserror():
    async def main():
        async with Server(lambda r: _lines(r, [])) as server:
            address = server.address
        with pytest.raises(OSError):
            await ControlConnections().post(address, "/update", b"{}", lambda line: None)

    asyncio.run(main())
