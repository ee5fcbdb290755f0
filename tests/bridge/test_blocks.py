"""The bridge's blocks (``megarl.bridge.blocks.regroup``): which groups a change of servers re-forms."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megarl.bridge.blocks import Block, regroup
from megarl.config.bridge import WeightUpdateConfig


def _servers(*names: str) -> list:
    return [SimpleNamespace(address=n) for n in names]


def _blocks(*runs: str) -> list[Block]:
    """Blocks formed from ``"abcd"``-style runs of one-letter addresses."""
    return [Block(_servers(*run), None, None, None) for run in runs]


def _names(runs) -> list[str]:
    return ["".join(s.address for s in run) for run in runs]


def test_a_first_connect_cuts_the_servers_into_blocks():
    kept, runs = regroup([], _servers(*"abcdefghij"), 4)
    assert kept == [] and _names(runs) == ["abcd", "efgh", "ij"]


def test_a_released_block_alone_re_forms_without_its_dead_server():
    blocks = _blocks("abcd", "efgh", "ij")
    blocks[1].release({"f"})
    kept, runs = regroup(blocks, _servers(*"abcdeghij"), 4)
    assert kept == [blocks[0], blocks[2]] and _names(runs) == ["egh"]


def test_a_server_gone_from_the_plan_re_forms_its_block_even_unreleased():
    blocks = _blocks("abcd", "efgh")
    kept, runs = regroup(blocks, _servers(*"abcdefg"), 4)
    assert kept == [blocks[0]] and _names(runs) == ["efg"]


def test_a_restarted_server_rejoins_its_released_blocks_survivors():
    blocks = _blocks("abcd", "efgh")
    blocks[0].release({"b"})  # restarted: same address, new workers
    kept, runs = regroup(blocks, _servers(*"abcdefgh"), 4)
    assert kept == [blocks[1]] and _names(runs) == ["abcd"]


def test_servers_joining_one_at_a_time_fill_the_smallest_block_that_has_room():
    blocks = _blocks("abcd", "efg", "hi")
    kept, runs = regroup(blocks, _servers(*"abcdefghiz"), 4)
    assert kept == blocks[:2] and _names(runs) == ["hiz"]  # not a group of one
    kept, runs = regroup(_blocks("abcd", "efgh"), _servers(*"abcdefghz"), 4)
    assert len(kept) == 2 and _names(runs) == ["z"]  # no room anywhere: a block of its own


def test_blocks_larger_than_the_size_re_form():
    blocks = _blocks("abcdefgh")
    kept, runs = regroup(blocks, _servers(*"abcdefgh"), 4)
    assert kept == [] and _names(runs) == ["abcd", "efgh"]
    with pytest.raises(ValueError, match="at least one server"):
        regroup([], _servers("a"), 0)


def test_broadcast_mode_and_zero_keep_one_group_of_every_server():
    assert WeightUpdateConfig(mode="sharded").group_servers(256) == 16
    assert WeightUpdateConfig(mode="sharded", servers_per_group=0).group_servers(256) == 256
    assert WeightUpdateConfig(mode="broadcast").group_servers(256) == 256
    assert WeightUpdateConfig(mode="sharded", extra_modes=["broadcast"]).group_servers(7) == 7


def test_every_groups_store_is_listening_before_its_port_is_told(tiny_model_dir):
    """The trainer binds each group's rendezvous port when it chooses it: a group of a later block
    forms minutes after the ports were chosen, and at 256 servers another socket took a port that
    had only been found free (EADDRINUSE, and 16 servers waited out ``init_timeout``)."""
    import socket

    from megarl.bridge.bridge import WeightBridge
    from megarl.bridge.source import TrainerCoords
    from megarl.config.allocation import TrainingAllocation
    from megarl.models.build import describe
    from tests.bridge.test_schedule import _FakeServer, _shapes

    path = tiny_model_dir("llama")
    config = WeightUpdateConfig(mode="sharded", servers_per_group=2, master_address="127.0.0.1")
    bridge = WeightBridge(config, describe(path, 1), _shapes(path), TrainingAllocation(), TrainerCoords(0))
    servers = [_FakeServer(9000 + i, 1) for i in range(5)]
    blocks = [bridge._block(run, config.modes) for run in regroup([], servers, 2)[1]]
    stores = bridge._wire(blocks)
    ports = [b.wiring.sharded.port for b in blocks]
    assert len(ports) == 3 and sorted(stores) == sorted(ports)
    for port in ports:
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", port))  # taken: the store listens there already
