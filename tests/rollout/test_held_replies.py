"""Replies that come while the generation client is paused are held, then parsed a batch per loop turn.

When a weight update pauses the servers, every request in flight comes back at once (aborted: 2,048 at
256 servers); parsing them all as they come took the pool's loop a second or more in one turn. They
are held at the client's gate instead and parsed as it opens, :data:`RELEASE_PER_TURN` per turn.
"""

from __future__ import annotations

import asyncio
import time

from megarl.api import ModelRequest
from megarl.api.io_struct import GenerationHyperparameters
from megarl.rollout.client import GenerationClient
from megarl.rollout.gate import RELEASE_PER_TURN
from megarl.serving import make_backend
from megarl.serving.servers import ServerSet
from tests.rollout.conftest import fast_config
from tests.rollout.helpers import LoopTurns

N = 4 * RELEASE_PER_TURN


def test_replies_that_come_while_paused_are_parsed_a_batch_per_turn_once_resumed(fake_servers):
    (server,) = fake_servers(1, token_delay=0.01)
    config, backend = fast_config(), make_backend("vllm")
    client = GenerationClient(config, backend, ServerSet(config, backend, [server.address]))
    parsed_at: list[int] = []
    parse = backend.parse_generate

    async def main():
        turns = LoopTurns(asyncio.get_running_loop(), done=lambda: len(parsed_at) == N)

        def recording(body):
            parsed_at.append(turns.now)
            return parse(body)

        backend.parse_generate = recording
        gconfig = GenerationHyperparameters(max_new_tokens=8)
        requests = [
            asyncio.ensure_future(client.agenerate(ModelRequest(input_ids=[11, 12, i], gconfig=gconfig)))
            for i in range(N)
        ]
        await asyncio.sleep(0.05)  # every request is on its way
        client.paused = True
        deadline = time.monotonic() + 20
        while server_posts(server) < N and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # 8 tokens at 10 ms: every reply is in
        assert parsed_at == [], f"{len(parsed_at)} replies parsed while the client was paused"
        turns.tick()
        client.paused = False
        responses = await asyncio.gather(*requests)
        assert all(len(r.output_tokens) == 8 for r in responses)
        await client.aclose()

    asyncio.run(main())
    most = LoopTurns.most_in_one_turn(parsed_at)
    assert len(parsed_at) == N and most <= RELEASE_PER_TURN, f"{most} held replies parsed in one turn"


def server_posts(server) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://{server.address}/_stats", timeout=5) as reply:
        return json.loads(reply.read()).get("generate", 0)  # a counter: absent until the first request
