"""The rollout side's server choice (``ServerSet.choose``): least loaded, sticky, health-aware, and at a
cost that does not grow with the fleet (a head at 1,024 servers chooses for every request it sends)."""

from __future__ import annotations

import re
import time

import pytest

from megarl.config.rollout import InferenceEngineConfig
from megarl.serving import make_backend
from megarl.serving.servers import NoHealthyServerError, Server, ServerSet

FLEET = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(1024)]


def _servers(**config) -> ServerSet:
    return ServerSet(InferenceEngineConfig(**config), make_backend("vllm"), FLEET)


def test_the_least_loaded_usable_server_is_chosen():
    servers = _servers()
    for i, server in enumerate(servers._servers):
        server.in_flight = 5 + i % 7
    servers._servers[700].in_flight = 1
    servers._servers[300].in_flight = 0
    servers.mark_unhealthy(FLEET[300], "failed an update")
    assert servers.choose().address == FLEET[700]
    servers.mark_healthy(FLEET[300])
    assert servers.choose().address == FLEET[300]


def test_a_failed_server_is_back_in_rotation_once_its_interval_ends():
    servers = _servers(unhealthy_retry_interval=0.2)
    for server in servers._servers:
        server.in_flight = 3
    servers._servers[9].in_flight = 0
    servers.mark_failed(servers._servers[9], ConnectionError("refused"))
    assert servers.choose().address != FLEET[9]
    time.sleep(0.3)
    assert servers.choose().address == FLEET[9]


def test_choosing_does_not_go_over_the_fleet_per_request(monkeypatch):
    """1,024 servers, 2,000 choices: the servers' health is read a couple of times per change of health,
    not 1,024 times per request (two million reads)."""
    reads = 0
    usable = Server.usable

    def counted(self, now):
        nonlocal reads
        reads += 1
        return usable(self, now)

    monkeypatch.setattr(Server, "usable", counted)
    servers = _servers()
    for i in range(2000):
        servers.choose()
        if i == 1000:
            servers.mark_unhealthy(FLEET[5], "failed an update")
    assert reads <= 4 * len(FLEET) + 2000, f"{reads:,} reads of a server's health for 2,000 choices"


def test_with_no_server_in_rotation_a_failed_choice_is_short_and_cheap():
    """Every one of 1,024 servers out of rotation (a fleet-wide restart): each waiting request asks again
    twice a second, so the error names each reason once with a few addresses (not 1,024 lines: 110 kB a
    choice before), and is formatted once per change of health."""
    servers = _servers()
    for address in FLEET[:1000]:
        servers.mark_unhealthy(address, "restarted by the launcher")
    for address in FLEET[1000:]:
        servers.mark_unhealthy(address, "failed an update")
    errors = []
    for rid in range(2000):
        with pytest.raises(NoHealthyServerError) as info:
            servers.choose(f"r{rid}")
        errors.append(info.value)
    message = str(errors[0])
    assert len(message) < 400, message
    assert "all 1024 inference servers are marked unhealthy" in message
    assert f"[{FLEET[0]}, {FLEET[1]}, {FLEET[2]} and 997 more] restarted by the launcher" in message
    assert f"[{FLEET[1000]}, {FLEET[1001]}, {FLEET[1002]} and 21 more] failed an update" in message
    assert all(e.reason is errors[0].reason for e in errors), "the reason was formatted again"
    servers.mark_healthy(FLEET[7])
    servers.mark_failed(servers._servers[7], ConnectionError("refused"))
    with pytest.raises(NoHealthyServerError, match=re.escape(f"[{FLEET[7]}] refused")):
        servers.choose()
