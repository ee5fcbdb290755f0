"""The probe's scoring calls (``ServerControl.ascore``, run on the control loop over its kept connections)
against a real aiohttp server speaking vLLM's ``/v1/models`` and ``/v1/completions``: the scores, one kept
connection for every call, and a named error for each bad reply."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from megarl.serving.http import ServerControlError
from megarl.serving.vllm import VLLMControl
from megarl.utils.network import find_free_port


class VLLMScorer:
    """A server in a thread of its own: ``prompt_logprobs`` of every token ``-token / 100``; a prompt that
    starts with 666 gets HTTP 500, one that starts with 777 a reply that is not JSON."""

    def __init__(self):
        self.peers: set = set()
        self.port = find_free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(10)

    def _run(self, started):
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        self._loop.run_until_complete(self.runner.setup())
        self._loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        started.set()
        self._loop.run_forever()

    async def models(self, request):
        self.peers.add(request.transport.get_extra_info("peername"))
        return web.json_response({"data": [{"id": "policy"}]})

    async def completions(self, request):
        self.peers.add(request.transport.get_extra_info("peername"))
        body = await request.json()
        prompt = body["prompt"]
        if prompt[0] == 666:
            return web.Response(status=500, text="engine dead")
        if prompt[0] == 777:
            return web.Response(text="<html>proxy error</html>")
        assert body["model"] == "policy" and body["prompt_logprobs"] == 0
        entries = [None] + [{str(t): {"logprob": -t / 100, "rank": 1}} for t in prompt[1:]]
        return web.json_response({"choices": [{"prompt_logprobs": entries}]})

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def scorer():
    server = VLLMScorer()
    yield server
    server.stop()


def test_scores_come_back_over_one_kept_connection(scorer):
    control = VLLMControl(scorer.address, tp=1, timeout=30)
    for _ in range(3):
        assert control.score([[1, 20, 30], [5, 7]]) == [[-0.2, -0.3], [-0.07]]
    assert len(scorer.peers) == 1, f"{len(scorer.peers)} connections for 7 calls"


def test_a_bad_reply_is_named(scorer):
    control = VLLMControl(scorer.address, tp=1, timeout=30)
    with pytest.raises(ServerControlError, match="/v1/completions: HTTP 500: engine dead"):
        control.score([[666, 1]])
    with pytest.raises(ServerControlError, match="reply is not JSON: b'<html>proxy error"):
        control.score([[777, 1]])


def test_a_server_that_does_not_listen_is_named_unreachable():
    control = VLLMControl(f"127.0.0.1:{find_free_port()}", tp=1, timeout=5)
    with pytest.raises(ServerControlError, match="unreachable"):
        control.score([[1, 2]])
