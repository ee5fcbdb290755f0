"""The probe's scoring calls (``ServerControl.ascore``, run on the control loop over its kept connections)
against a real aiohttp server speaking vLLM's ``/v1/models`` and ``/v1/completions``: the scores, one kept
connection for every call, and a named error for each bad reply."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from megarl.serving.control_loop import control_loop
from megarl.serving.http import ServerControlError
from megarl.serving.vllm import VLLMControl
from megarl.utils.network import find_free_port


class VLLMScorer:
    """A server in a thread of its own: ``prompt_logprobs`` of every token ``-token / 100``; a prompt that
    starts with 666 gets HTTP 500, one that starts with 777 a reply that is not JSON."""

    def __init__(self):
        self.peers: set = set()
        self.requests: list = []
        self.asked_for: list = []
        self.in_flight = self.most_in_flight = 0
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
        prompts, k = body["prompt"], body["prompt_logprobs"]
        if prompts[0][0] == 666:
            return web.Response(status=500, text="engine dead")
        if prompts[0][0] == 777:
            return web.Response(text="<html>proxy error</html>")
        self.asked_for.append(body["model"])
        self.requests.append(prompts)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.02)  # a request sent before this one answers would overlap it
        self.in_flight -= 1
        choices = [
            {"index": i, "prompt_logprobs": [None] + [self.entry(t, k) for t in prompt[1:]]}
            for i, prompt in enumerate(prompts)
        ]
        if prompts[0][0] == 888:  # one position short
            choices[0]["prompt_logprobs"].pop()
        return web.json_response({"choices": choices[::-1]})  # any order: each names its prompt

    @staticmethod
    def entry(token: int, k: int) -> dict:
        """The prompt token's own logprob (ranked below the top k) and the top k: tokens 1001.. at -j / 10."""
        top = {str(1000 + j): {"logprob": -j / 10, "rank": j} for j in range(k, 0, -1)}
        return {**top, str(token): {"logprob": -token / 100, "rank": k + 1}}

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
    assert len(scorer.peers) == 1, f"{len(scorer.peers)} connections for 4 calls"
    assert scorer.requests == [[[1, 20, 30], [5, 7]]] * 3  # both sequences in one request
    assert scorer.asked_for == ["policy"] * 3  # the served model, as /v1/models names it


def test_an_adapter_is_scored_one_sequence_at_a_time(scorer):
    """vLLM maps a LoRA adapter's prompt logprobs right only for a request alone in its batch (beside another
    its worker fails, vllm-project/vllm#16668): with an adapter each sequence is a request of its own, sent
    once the previous one has answered."""
    control = VLLMControl(scorer.address, tp=1, timeout=30)
    scores, topk = control_loop().run(control.aprobe([[1, 20, 30], [5, 7]], 1, adapter="megarl-lora-v3"))
    assert scores == [[-0.2, -0.3], [-0.07]] and topk == [[{1001: -0.1}] * 2, [{1001: -0.1}]]
    assert scorer.requests == [[[1, 20, 30]], [[5, 7]]] and scorer.asked_for == ["megarl-lora-v3"] * 2
    assert scorer.most_in_flight == 1


def test_one_request_scores_the_probe_and_its_top_k(scorer):
    control = VLLMControl(scorer.address, tp=1, timeout=30)
    scores, topk = control_loop().run(control.aprobe([[1, 20, 30], [5, 7]], 2))
    assert scores == [[-0.2, -0.3], [-0.07]]
    assert topk == [[{1001: -0.1, 1002: -0.2}] * 2, [{1001: -0.1, 1002: -0.2}]]
    assert list(topk[0][0]) == [1001, 1002]  # most likely first
    assert len(scorer.requests) == 1
    assert control.score_topk([[5, 7]], 1) == [[{1001: -0.1}]]


def test_a_bad_reply_is_named(scorer):
    control = VLLMControl(scorer.address, tp=1, timeout=30)
    with pytest.raises(ServerControlError, match="/v1/completions: HTTP 500: engine dead"):
        control.score([[666, 1]])
    with pytest.raises(ServerControlError, match="reply is not JSON: b'<html>proxy error"):
        control.score([[777, 1]])
    with pytest.raises(ServerControlError, match=r"prompt_logprobs for \[0, 1\] positions, asked for \[1, 1\]"):
        control.score([[888, 1], [2, 3]])


def test_a_server_that_does_not_listen_is_named_unreachable():
    control = VLLMControl(f"127.0.0.1:{find_free_port()}", tp=1, timeout=5)
    with pytest.raises(ServerControlError, match="unreachable"):
        control.score([[1, 2]])
