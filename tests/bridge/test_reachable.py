"""The weight bridge refuses to announce a loopback address to servers on other hosts (no default route
and no interface named: the groups would never form, and the trainer would wait out init_timeout)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megarl.bridge.bridge import WeightBridge, WeightBridgeError


def _bridge(*server_addresses: str) -> WeightBridge:
    bridge = WeightBridge.__new__(WeightBridge)
    bridge.servers = [SimpleNamespace(address=a) for a in server_addresses]
    return bridge


HERE = {"127.0.0.1", "10.0.0.5"}


def test_loopback_host_with_a_server_elsewhere_is_refused_naming_both():
    bridge = _bridge("10.0.0.7:8000", "127.0.0.1:8001")
    with pytest.raises(
        WeightBridgeError,
        match=r"rank 1 would announce 127.0.0.1 to servers on other hosts "
        r"\(10.0.0.7:8000\).*launcher.slurm.network_interface",
    ):
        bridge._check_reachable([("10.0.0.5", [], HERE), ("127.0.0.1", [29600], HERE)])


@pytest.mark.parametrize(
    ("servers", "ranks"),
    [
        (["127.0.0.1:8000"], [("127.0.0.1", [29600], HERE)]),  # one machine: loopback everywhere
        (["10.0.0.5:8000"], [("127.0.0.1", [29600], HERE)]),  # a server on this host's own address
        (["10.0.0.7:8000"], [("10.0.0.5", [29600], HERE)]),  # the cluster interface's address
        (["10.0.0.7:8000"], [("127.0.0.1", [], HERE)]),  # a rank that hosts no group announces nothing
    ],
)
def test_reachable_layouts_pass(servers, ranks):
    _bridge(*servers)._check_reachable(ranks)
