"""tests/actor/dist_utils.py: the multi-rank runner the actor tests start their ranks with."""

from __future__ import annotations

import socket

import torch.distributed as dist

from tests.actor import dist_utils


def rank_of_a_gloo_group() -> int:
    """A rank's target: join the group at $MASTER_PORT (rank 0 binds its store there)."""
    dist.init_process_group("gloo")
    return dist.get_rank()


def test_ranks_whose_port_was_taken_start_again_on_another(monkeypatch):
    """The port found free is taken before rank 0 binds it (here: held by this test): the ranks fail
    with EADDRINUSE and run again on the next port instead of failing the test."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = dist_utils.find_free_port
        monkeypatch.setattr(dist_utils, "find_free_port", lambda: ports.pop(0) if ports else real())
        assert dist_utils.run_ranks(2, "tests.actor.test_dist_utils:rank_of_a_gloo_group", timeout=120) == [0, 1]
        assert not ports  # the taken port was tried first


def test_other_failures_are_not_retried():
    assert not dist_utils._lost_the_port("ValueError: bad config", 1234)
    assert not dist_utils._lost_the_port("port: 999, useIpv6: false, code: -98, name: EADDRINUSE", 1234)
    assert dist_utils._lost_the_port("port: 1234, useIpv6: false, code: -98, name: EADDRINUSE", 1234)
