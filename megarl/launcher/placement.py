"""Where each process of a run goes: which node and devices every server and trainer rank gets.

One node: servers take the first devices, the trainer the rest. Several nodes: the
inference part takes whole nodes first, the trainer the remaining ones (the
allocation check guarantees each part fills whole nodes). Colocated (``|``): servers
and trainer ranks both start at the first device of the first node and share them. The same plan drives the
local launcher and the rendered sbatch script, so both place things identically.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.allocation import AllocationMode, validate_allocation


@dataclass(frozen=True)
class ServerSlot:
    """One inference server: its index, node (index into the job's node list) and devices."""

    index: int
    node: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Servers, and the trainer's nodes with the devices it uses on each."""

    servers: tuple[ServerSlot, ...]
    trainer_nodes: tuple[int, ...]
    trainer_devices: tuple[int, ...]

    @property
    def trainer_procs_per_node(self) -> int:
        return len(self.trainer_devices)


def plan_placement(alloc: AllocationMode, n_nodes: int, n_gpus_per_node: int) -> Placement:
    """Place ``alloc`` on ``n_nodes`` x ``n_gpus_per_node`` devices (validated first)."""
    validate_allocation(alloc, n_nodes=n_nodes, n_gpus_per_node=n_gpus_per_node)
    servers = []
    if alloc.inference is not None:
        width = alloc.inference.devices_per_server
        per_node = n_gpus_per_node // width
        for i in range(alloc.inference.dp):
            first = (i % per_node) * width
            servers.append(ServerSlot(i, i // per_node, tuple(range(first, first + width))))
    if alloc.train is None:
        return Placement(tuple(servers), (), ())
    if alloc.colocated:
        return Placement(tuple(servers), tuple(range(n_nodes)), tuple(range(alloc.train.world_size // n_nodes)))
    if n_nodes == 1:
        used = alloc.inference.world_size if alloc.inference else 0
        return Placement(tuple(servers), (0,), tuple(range(used, used + alloc.train.world_size)))
    inference_nodes = alloc.inference.world_size // n_gpus_per_node if alloc.inference else 0
    return Placement(tuple(servers), tuple(range(inference_nodes, n_nodes)), tuple(range(n_gpus_per_node)))
