"""Placement of servers and trainer ranks on nodes and devices."""

import pytest

from megarl.config.allocation import AllocationError, AllocationMode
from megarl.launcher.placement import ServerSlot, plan_placement


def plan(spec, nodes, per_node):
    return plan_placement(AllocationMode.from_str(spec), nodes, per_node)


def test_one_node_servers_first_then_trainer():
    p = plan("vllm:d2t2+megatron:d2p1t2", 1, 8)
    assert p.servers == (ServerSlot(0, 0, (0, 1)), ServerSlot(1, 0, (2, 3)))
    assert p.trainer_nodes == (0,) and p.trainer_devices == (4, 5, 6, 7)


def test_cpu_default_one_server_one_rank():
    p = plan("vllm:d1t1+megatron:d1p1t1", 1, 2)
    assert p.servers == (ServerSlot(0, 0, (0,)),)
    assert p.trainer_devices == (1,) and p.trainer_procs_per_node == 1


def test_multi_node_parts_get_whole_nodes():
    p = plan("vllm:d48t2+megatron:d4p2t4", 16, 8)
    assert len(p.servers) == 48
    assert {s.node for s in p.servers} == set(range(12))
    assert p.servers[5] == ServerSlot(5, 1, (2, 3))
    assert p.trainer_nodes == tuple(range(12, 16)) and p.trainer_procs_per_node == 8
    # every (node, device) is used exactly once
    used = [(s.node, d) for s in p.servers for d in s.devices]
    used += [(n, d) for n in p.trainer_nodes for d in p.trainer_devices]
    assert len(used) == len(set(used)) == 128


def test_colocated_servers_and_trainer_share_every_device():
    p = plan("vllm:d1t1|megatron:d1p1t1", 1, 1)
    assert p.servers == (ServerSlot(0, 0, (0,)),) and p.trainer_nodes == (0,) and p.trainer_devices == (0,)
    p = plan("vllm:d16t2|megatron:d4p2t4", 4, 8)  # servers on every node, trainer ranks on every node too
    assert {s.node for s in p.servers} == {0, 1, 2, 3} and p.servers[5] == ServerSlot(5, 1, (2, 3))
    assert p.trainer_nodes == (0, 1, 2, 3) and p.trainer_devices == tuple(range(8))
    served = sorted((s.node, d) for s in p.servers for d in s.devices)
    assert served == sorted((n, d) for n in p.trainer_nodes for d in p.trainer_devices)


def test_training_only_and_bad_cluster():
    p = plan("megatron:d4p1t2", 1, 8)
    assert p.servers == () and p.trainer_devices == tuple(range(8))
    with pytest.raises(AllocationError, match="= 16 devices, but the cluster has 1 nodes x 8"):
        plan("vllm:d4t2+megatron:d2p2t2", 1, 8)
