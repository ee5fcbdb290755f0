"""A generation reply that dies mid-body ends within the request's deadline (``rollout.request_timeout``).

The faulty server is a raw asyncio socket server, so the test decides every byte on the wire: the
status line and headers announce a Content-Length, then the server resets the connection (RST:
SO_LINGER 0) at once or after half the body, or sends half the body and goes quiet with the socket
open. A reset is a connection failure: retried with backoff, then the server is out of rotation and
the request goes to another server. A body that stops arriving is cut once its attempt's share of the
deadline is spent and retried; either way the request ends within ``request_timeout`` of its first
attempt. Bounds are the configured deadline plus a slack for a loaded machine.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest

from megarl.api import ModelRequest
from megarl.api.io_struct import GenerationHyperparameters
from megarl.rollout.client import GenerationClient
from megarl.serving import make_backend
from megarl.serving.http import InferenceServerError, ServerUnavailableError, arequest_with_retry
from megarl.serving.kept_http import KeptConnections
from megarl.serving.servers import ServerSet
from tests.rollout.conftest import fast_config, make_engine, start_fake_servers
from tests.rollout.helpers import expected_tokens

DEADLINE = 3.0  # rollout.request_timeout
RETRIES = 3
SLACK = 5.0  # a loaded 2-core machine
PROMPT = [101, 102, 103, 104, 105]
BODY = b'{"id": "cmpl-cut", "object": "text_completion", "choices": [{"index": 0, "text": "", "token_ids": [1]}]}'
MODES = ("reset_after_headers", "reset_mid_body", "stall_mid_body")


class CutReplyServer:
    """Answers health checks (any GET) with 200 and every POST with a 200 reply that dies as ``mode`` says."""

    def __init__(self, mode: str):
        self.mode = mode
        self.posts: list[float] = []  # monotonic time of each generation request
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._started.set()
        self._loop.run_until_complete(self._stop.wait())
        self._server.close()
        self._loop.run_until_complete(self._server.wait_closed())

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: health checks may share a connection
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self.posts.append(time.monotonic())
                await self._cut_reply(writer)
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def _cut_reply(self, writer: asyncio.StreamWriter) -> None:
        headers = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
        sent = headers if self.mode == "reset_after_headers" else headers + BODY[: len(BODY) // 2]
        writer.write(sent)
        await writer.drain()
        if self.mode == "stall_mid_body":
            await self._stop.wait()  # the socket stays open and silent
            writer.close()
            return
        await asyncio.sleep(0.05)  # the client has the bytes; now the reset
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()


@pytest.fixture
def cut_server(request):
    server = CutReplyServer(request.param)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def good_server(tmp_path_factory):
    (server,) = start_fake_servers(1, log_dir=tmp_path_factory.mktemp("good-server"))
    yield server
    server.stop(timeout=5)


CONFIG = {"request_timeout": DEADLINE, "request_retries": RETRIES, "retry_backoff": 0.05}


@pytest.mark.parametrize("cut_server", MODES, indirect=True)
def test_arequest_with_retry_ends_within_the_deadline(cut_server):
    """The rollout side's policy (built as the generation client builds it) against each cut: the call
    ends, failed, within ``request_timeout`` of its first attempt; a reset after all its retries, as a
    connection failure; a stalled body cut by its read timeout (more than one attempt fits the deadline)."""
    config, backend = fast_config(**CONFIG), make_backend("vllm")
    policy = GenerationClient(config, backend, ServerSet(config, backend, [cut_server.address])).policy
    payload = backend.generate_payload(PROMPT, GenerationHyperparameters(max_new_tokens=8), 8, 0)

    async def call():
        connections = KeptConnections(4)
        try:
            return await arequest_with_retry(
                connections, cut_server.address, backend.generate_endpoint, payload, policy=policy
            )
        finally:
            connections.close()

    start = time.monotonic()
    with pytest.raises(InferenceServerError) as info:
        asyncio.run(call())
    took = time.monotonic() - start
    assert took <= DEADLINE + SLACK, f"{cut_server.mode}: {took:.1f}s, past the {DEADLINE:g}s deadline"
    if cut_server.mode == "stall_mid_body":
        assert info.value.kind == "timeout" and "no complete reply" in str(info.value)
        assert len(cut_server.posts) >= 2, "the stalled body was not cut before the deadline"
    else:
        assert isinstance(info.value, ServerUnavailableError) and info.value.kind == "connection"
        assert info.value.attempts == len(cut_server.posts) == RETRIES + 1


@pytest.mark.parametrize("cut_server", MODES, indirect=True)
def test_agenerate_with_a_server_that_cuts_replies(cut_server, good_server):
    """``agenerate`` through the engine on two servers, the faulty one chosen first: a reset reply is
    retried, the server taken out of rotation and the request answered by the other server; a stalled
    body fails the request as a timeout (its episode runs again). Either within the deadline."""
    engine = make_engine([cut_server.address, good_server.address], **CONFIG)
    request = ModelRequest(input_ids=PROMPT, gconfig=GenerationHyperparameters(n_samples=1, max_new_tokens=8))
    start = time.monotonic()
    try:
        if cut_server.mode == "stall_mid_body":
            with pytest.raises(InferenceServerError) as info:
                asyncio.run(engine.agenerate(request))
            assert info.value.kind == "timeout" and info.value.address == cut_server.address
        else:
            resp = asyncio.run(engine.agenerate(request))
            assert resp.server == good_server.address
            assert resp.output_tokens == expected_tokens(len(PROMPT), 8)[0]
            assert len(cut_server.posts) == RETRIES + 1
            assert not engine.servers._servers[0].usable(time.monotonic()), "the faulty server is still in rotation"
        took = time.monotonic() - start
    finally:
        engine.destroy()
    assert took <= DEADLINE + SLACK, f"{cut_server.mode}: {took:.1f}s, past the {DEADLINE:g}s deadline"
