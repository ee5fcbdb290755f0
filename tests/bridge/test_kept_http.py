"""Kept-alive connections (megarl.serving.kept_http) against a real aiohttp server: an update call's lines
as they come, kept connections, a server that closes or restarts, a reply cut short, deadlines, errors,
the limit on open connections."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from megarl.serving.kept_http import KeptConnections, ReplyTimeout


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
            connections, seen = KeptConnections(), []
            for _ in range(3):
                reply = await connections.request(server.address, "/update", b'{"v": 1}', on_line=seen.append)
                assert reply.status == 200
            assert seen == [b'{"paused": true}', b'{"version": "1"}'] * 3
            assert len(set(server.peers)) == 1, "each call opened a connection of its own"
            connections.close()

    asyncio.run(main())


def test_a_connection_the_server_closed_while_idle_is_replaced():
    """The server closes idle connections (keep-alive over, or it restarted): the next call opens a new one."""

    async def main():
        async with Server(lambda r: _lines(r, [b'{"version": "1"}']), keepalive_s=0.1) as server:
            connections, seen = KeptConnections(), []
            await connections.request(server.address, "/update", b"{}", on_line=seen.append)
            await asyncio.sleep(0.5)
            reply = await connections.request(server.address, "/update", b"{}", on_line=seen.append)
            assert reply.status == 200 and len(seen) == 2 and len(set(server.peers)) == 2
            connections.close()

    asyncio.run(main())


def test_an_error_status_returns_the_start_of_its_body():
    async def main():
        async with Server(lambda r: asyncio.sleep(0, web.Response(status=409, text="busy " * 2000))) as server:
            reply = await KeptConnections().request(server.address, "/update", b"{}", on_line=lambda line: None)
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
            connections, seen = KeptConnections(), []
            with pytest.raises(ConnectionError, match="mid-reply"):
                await connections.request(server.address, "/update", b"{}", on_line=seen.append)
            assert seen == [b'{"paused": true}']
            assert (await connections.request(server.address, "/update", b"{}", on_line=seen.append)).status == 200
            assert seen[-1] == b'{"version": "2"}'

    asyncio.run(main())


def test_a_line_the_caller_refuses_ends_the_call_with_its_error():
    async def main():
        async with Server(lambda r: _lines(r, [b"not json", b'{"version": "1"}'])) as server:

            def refuse(line: bytes):
                raise ValueError(f"bad line {line!r}")

            with pytest.raises(ValueError, match="bad line b'not json'"):
                await KeptConnections().request(server.address, "/update", b"{}", on_line=refuse)

    asyncio.run(main())


def test_calls_to_one_server_at_once_each_get_a_connection():
    async def main():
        async with Server(lambda r: _lines(r, [b'{"version": "1"}'], gap_s=0.1)) as server:
            connections = KeptConnections()
            replies = await asyncio.gather(
                *(connections.request(server.address, "/update", b"{}", on_line=lambda line: None) for _ in range(3))
            )
            assert [r.status for r in replies] == [200] * 3 and len(set(server.peers)) == 3
            connections.close()

    asyncio.run(main())


def test_a_cancelled_call_closes_its_connection():
    async def main():
        async with Server(lambda r: _lines(r, [b'{"version": "1"}'], gap_s=5.0)) as server:
            connections = KeptConnections()
            call = asyncio.ensure_future(
                connections.request(server.address, "/update", b"{}", on_line=lambda line: None)
            )
            await asyncio.sleep(0.2)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert not connections._open and not connections._idle.get(server.address), "the connection was kept"

    asyncio.run(main())


def test_a_server_that_does_not_listen_raises_oserror():
    async def main():
        async with Server(lambda r: _lines(r, [])) as server:
            address = server.address
        with pytest.raises(OSError):
            await KeptConnections().request(address, "/update", b"{}", on_line=lambda line: None)

    asyncio.run(main())


def test_a_whole_body_comes_back_and_each_of_a_servers_idle_connections_is_reused():
    """Without ``on_line`` the reply's body is returned whole; three requests at once open three connections,
    which the next three reuse (no fourth connection)."""

    async def main():
        async def handler(request):
            await asyncio.sleep(0.05)
            return web.json_response({"echo": await request.json()})

        async with Server(handler) as server:
            connections = KeptConnections()
            for round_ in range(2):
                replies = await asyncio.gather(
                    *(connections.request(server.address, "/update", b'{"i": %d}' % i) for i in range(3))
                )
                assert [r.body for r in replies] == [b'{"echo": {"i": %d}}' % i for i in range(3)]
            assert len(set(server.peers)) == 3, f"{len(set(server.peers))} connections for 3 at a time"
            connections.close()

    asyncio.run(main())


def test_the_deadline_ends_a_request_whose_reply_does_not_begin():
    async def main():
        async with Server(lambda r: asyncio.sleep(3)) as server:
            connections = KeptConnections()
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(ReplyTimeout) as caught:
                await connections.request(server.address, "/update", b"{}", deadline=start + 0.3, body_timeout=5.0)
            assert caught.value.waiting_for == "headers" and loop.time() - start < 2.0
            assert not connections._open, "a timed-out connection was kept"

    asyncio.run(main())


def test_a_body_that_stalls_after_its_headers_ends_at_its_body_timeout():
    async def main():
        async def handler(request):
            reply = web.StreamResponse()
            reply.enable_chunked_encoding()
            await reply.prepare(request)
            await reply.write(b'{"partial": ')
            await asyncio.sleep(3)
            return reply

        async with Server(handler) as server:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(ReplyTimeout) as caught:
                await KeptConnections().request(server.address, "/update", b"{}", deadline=start + 20, body_timeout=0.3)
            assert caught.value.waiting_for == "body" and loop.time() - start < 2.0

    asyncio.run(main())


def test_the_limit_bounds_open_connections_across_servers():
    """Limit 2, four servers asked at once: never more than two connections open, every request answered."""

    async def main():
        async def handler(request):
            await asyncio.sleep(0.05)
            return web.json_response({})

        servers = [Server(handler) for _ in range(4)]
        for server in servers:
            await server.__aenter__()
        connections, peak = KeptConnections(limit=2), 0

        async def one(server):
            nonlocal peak
            reply = await connections.request(server.address, "/update", b"{}")
            peak = max(peak, len(connections._open))
            return reply.status

        try:
            assert await asyncio.gather(*(one(s) for s in servers * 3)) == [200] * 12
            assert peak <= 2 and len(connections._open) <= 2
        finally:
            connections.close()
            for server in servers:
                await server.__aexit__()

    asyncio.run(main())


def test_a_connection_idle_past_max_idle_s_is_not_reused():
    async def main():
        async with Server(lambda r: asyncio.sleep(0, web.json_response({}))) as server:
            connections = KeptConnections(max_idle_s=0.2)
            await connections.request(server.address, "/update", b"{}")
            await connections.request(server.address, "/update", b"{}")
            await asyncio.sleep(0.4)
            await connections.request(server.address, "/update", b"{}")
            assert len(set(server.peers)) == 2 and len(connections._open) == 1
            connections.close()

    asyncio.run(main())
