"""One call per server per update, and deadlines relative to the fleet (megarl.bridge.update_round).

Real HTTP servers (aiohttp, on a loop of their own) answer megarl's update route with the route's own
code (``megarl.serving.vllm_route.update_lines``) over steps whose timing each test sets.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import dataclass

import pytest
from aiohttp import web

from megarl.bridge import update_round
from megarl.bridge.update_round import UpdateRound, stage_deadline
from megarl.config.bridge import WeightUpdateConfig
from megarl.serving.vllm import UPDATE_ROUTE, VLLMControl
from tests.rollout.fake_server import serve_update_route


@dataclass
class Behaviour:
    pause_s: float = 0.0
    receive_s: float = 0.05
    error: str = ""


class _Steps:
    def __init__(self, behaviour: Behaviour, log: list):
        self.b, self.log = behaviour, log

    async def pause(self):
        self.log.append("pause")
        await asyncio.sleep(self.b.pause_s)

    async def start(self):
        pass

    async def receive(self, mode, path):
        await asyncio.sleep(self.b.receive_s)
        if self.b.error:
            raise RuntimeError(self.b.error)

    async def finish(self, version):
        self.log.append(f"finish {version}")

    async def resume(self):
        self.log.append("resume")


class Servers:
    """``n`` HTTP servers on a loop thread; ``calls[i]`` every request server i got."""

    def __init__(self, behaviours: list[Behaviour]):
        self.behaviours, self.calls = behaviours, [[] for _ in behaviours]
        self.peers = [[] for _ in behaviours]
        """Per server, the client's (host, port) of each request: one per connection."""
        self.steps_log = [[] for _ in behaviours]
        self.loop = asyncio.new_event_loop()
        self.addresses: list[str] = []
        ready = threading.Event()
        threading.Thread(target=self._main, args=(ready,), daemon=True).start()
        ready.wait(30)

    def _main(self, ready):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        ready.set()
        self.loop.run_forever()

    async def _start(self):
        for i, b in enumerate(self.behaviours):
            app = web.Application()

            async def update(request, i=i, b=b):
                self.calls[i].append(request.path)
                self.peers[i].append(request.transport.get_extra_info("peername"))
                return await serve_update_route(request, _Steps(b, self.steps_log[i]))

            app.router.add_post(UPDATE_ROUTE, update)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.addresses.append(f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}")


def _config(**kw) -> WeightUpdateConfig:
    return WeightUpdateConfig(mode="disk", disk_path="/tmp/unused", **kw)


def _round(servers: Servers, config: WeightUpdateConfig, version: int = 1, resume=False) -> tuple[dict, float]:
    controls = [VLLMControl(a, tp=1) for a in servers.addresses]
    start = time.monotonic()
    rnd = UpdateRound(controls, "disk", "/tmp/unused", version, config, resume=resume)
    rnd.start()
    rnd.wait_paused()
    failed = rnd.wait_committed()
    return failed, time.monotonic() - start


def test_every_server_updates_in_one_call():
    servers = Servers([Behaviour() for _ in range(8)])
    failed, _ = _round(servers, _config(), version=3)
    assert failed == {}
    assert all(calls == [UPDATE_ROUTE] for calls in servers.calls)
    assert all(log == ["pause", "finish 3"] for log in servers.steps_log)  # paused until the rollout resumes


def test_servers_resume_themselves_when_asked():
    """A bridge used without a rollout side (``connect_engine(..., servers=...)``) has each server generate
    again once committed: nobody else would resume it."""
    servers = Servers([Behaviour() for _ in range(2)])
    failed, _ = _round(servers, _config(), version=4, resume=True)
    assert failed == {} and all(log == ["pause", "finish 4", "resume"] for log in servers.steps_log)


def test_the_next_update_reuses_each_servers_connection():
    """The reply is read to its end, so its connection goes back to the control session's pool and the
    next update's call to that server goes over it (a new TCP connection per server per update cost the
    trainer milliseconds each at 1,024 servers). Before: the call returned on its version line and the
    connection, its reply unfinished, was closed."""
    servers = Servers([Behaviour() for _ in range(4)])
    for version in (1, 2, 3):
        failed, _ = _round(servers, _config(), version=version, resume=True)
        assert failed == {}
    assert all(len(peers) == 3 and len(set(peers)) == 1 for peers in servers.peers), servers.peers


def test_a_slow_receiver_is_evicted_at_its_relative_deadline_not_the_cap():
    servers = Servers([Behaviour() for _ in range(7)] + [Behaviour(receive_s=30.0)])
    failed, seconds = _round(servers, _config(update_timeout=600.0, straggler_floor_s=1.0, straggler_factor=4.0))
    slow = servers.addresses[-1]
    assert list(failed) == [slow] and "not committed within 1.0s" in failed[slow]
    assert seconds < 10.0, f"the slow server held the update {seconds:.1f}s (relative deadline 1 s)"


def test_the_commit_deadline_counts_from_the_transfers_start():
    """Receivers commit while the trainer sends (here a 1 s transfer): their answers count from the
    transfer's start, so the median the eviction names is theirs (0.3 s), where counting from the wait's
    start made every answer before it 0 s ("4x the median 0.00s")."""
    servers = Servers([Behaviour(receive_s=0.3) for _ in range(7)] + [Behaviour(receive_s=30.0)])
    config = _config(update_timeout=600.0, straggler_floor_s=1.5, straggler_factor=4.0)
    rnd = UpdateRound([VLLMControl(a, tp=1) for a in servers.addresses], "disk", "/tmp/unused", 1, config)
    rnd.start()
    rnd.wait_paused()
    time.sleep(1.0)  # the transfer
    failed = rnd.wait_committed()
    slow = servers.addresses[-1]
    median = float(re.search(r"4x the median ([0-9.]+)s", failed[slow])[1])
    assert list(failed) == [slow] and 0.25 <= median <= 0.9, failed[slow]


def test_the_wait_does_not_wake_at_every_answer(monkeypatch):
    """Rank 0's wait recomputes the deadline by the clock, not at each server's answer: at 1,024 servers a
    wake-up per answer and stage was 2,048 tasks and timers of the control loop per update."""
    looks = []
    original = update_round.stage_deadline
    monkeypatch.setattr(update_round, "stage_deadline", lambda *a, **k: looks.append(1) or original(*a, **k))
    servers = Servers([Behaviour(receive_s=0.05) for _ in range(64)])
    failed, seconds = _round(servers, _config())
    assert failed == {}
    assert len(looks) <= 4 + 2 * seconds / update_round.DEADLINE_TICK_S, f"{len(looks)} looks in {seconds:.2f}s"


def test_a_server_whose_update_route_hangs_is_evicted_and_named():
    """Its health check would answer; its control route never gets past the pause."""
    servers = Servers([Behaviour() for _ in range(3)] + [Behaviour(pause_s=3600.0)])
    failed, seconds = _round(servers, _config(straggler_floor_s=1.0))
    hung = servers.addresses[-1]
    assert list(failed) == [hung] and "not paused within" in failed[hung]
    assert seconds < 10.0


def test_an_error_in_the_server_is_reported_with_its_reason():
    servers = Servers([Behaviour(), Behaviour(error="no safetensors in /tmp/unused")])
    failed, _ = _round(servers, _config())
    assert list(failed) == [servers.addresses[1]]
    assert "no safetensors in /tmp/unused" in failed[servers.addresses[1]]


def test_a_dead_server_fails_at_once():
    servers = Servers([Behaviour()])
    dead = VLLMControl("127.0.0.1:1", tp=1)  # nothing listens on port 1
    rnd = UpdateRound([VLLMControl(servers.addresses[0], tp=1), dead], "disk", "/x", 1, _config())
    start = time.monotonic()
    rnd.start()
    rnd.wait_paused()
    failed = rnd.wait_committed()
    assert list(failed) == [dead.address] and "connection failed" in failed[dead.address]
    assert time.monotonic() - start < 10.0


@pytest.mark.parametrize(
    "answered, servers, expected",
    [
        ([], 8, 1800.0),  # nobody answered yet: the cap
        ([1.0, 1.0, 1.0], 8, 1800.0),  # fewer than half
        ([1.0, 1.0, 2.0, 2.0], 8, 30.0),  # half: max(floor, 4 x median 1.5)
        ([20.0, 20.0, 20.0, 20.0], 8, 80.0),  # 4 x median
        ([1000.0] * 8, 8, 1800.0),  # never beyond the cap
    ],
)
def test_stage_deadline(answered, servers, expected):
    assert stage_deadline(answered, servers, _config()) == pytest.approx(expected)


def test_no_relative_deadline_when_turned_off():
    assert stage_deadline([1.0] * 8, 8, _config(straggler_factor=0.0)) == 1800.0


def test_the_config_refuses_a_factor_below_one():
    with pytest.raises(ValueError, match="straggler_factor"):
        _config(straggler_factor=0.5).check()


def test_a_server_without_megarls_route_is_named_with_how_to_start_it():
    """A vLLM server started by hand without megarl's middleware answers 404: the error says what to do."""
    app = web.Application()  # no update route
    loop, addresses = asyncio.new_event_loop(), []
    ready = threading.Event()

    async def start():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        addresses.append(f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}")

    def main():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=main, daemon=True).start()
    ready.wait(30)
    rnd = UpdateRound([VLLMControl(addresses[0], tp=1)], "disk", "/x", 1, _config())
    rnd.start()
    failed = rnd.wait_paused()
    assert "HTTP 404" in failed[addresses[0]] and "megarl serve" in failed[addresses[0]]
