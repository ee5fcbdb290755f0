"""Process groups of the bridge, beside the trainer's default group and vLLM's own groups.

A bridge group spans some trainer ranks and inference workers. It is built on its own
``TCPStore`` (hosted by the group's rank 0, a trainer rank) rather than on any default
group, so it can live in processes that already belong to other groups (the trainer's
Megatron groups, vLLM's TP group). Backend: NCCL when the tensors live on a GPU, gloo on
CPU; the calls made on the group are the same.

:func:`join_group` follows SGLang's ``init_custom_process_group`` step for step (a
``tcp://`` store, a ``PrefixStore`` named after the group, ``_new_process_group_helper``),
so a trainer joins an SGLang server's weight-update group with it, and megarl's own
vLLM receivers join megarl's groups the same way. Collectives then take ranks *within*
the group (the group is registered with an identity rank map).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class BridgeGroupError(RuntimeError):
    """A bridge group could not be formed (a peer missing, a port taken, a timeout)."""


def default_backend(device: torch.device | str) -> str:
    """``nccl`` for CUDA tensors, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def host_store(host: str, timeout: float) -> dist.TCPStore:
    """A group's rendezvous store, listening already on a port the system chose (``store.port``): it is
    bound before anyone is told the port, so nothing else can take the port in between (a group of a
    later block forms minutes after the ports were chosen)."""
    try:
        return dist.TCPStore(host, 0, None, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, dist.DistStoreError, OSError) as e:
        raise BridgeGroupError(f"hosting a bridge group's store on {host} failed: {e}") from e


def join_group(
    host: str,
    port: int,
    world_size: int,
    rank: int,
    group_name: str,
    backend: str,
    timeout: float,
    store: dist.TCPStore | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group ``group_name`` of ``world_size`` members rendezvousing at ``host:port``;
    ``store``: rank 0's store, already listening there (:func:`host_store`; None: made here)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    if not 0 <= rank < world_size:
        raise ValueError(f"bridge group {group_name!r}: rank {rank} outside world size {world_size}")
    wait = timedelta(seconds=timeout)
    try:
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=wait, multi_tenant=True)
        pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=wait
        )
    except (RuntimeError, dist.DistStoreError, OSError) as e:
        raise BridgeGroupError(
            f"joining bridge group {group_name!r} at {host}:{port} as rank {rank}/{world_size} ({backend}) failed: {e}"
        ) from e
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    logger.info("joined bridge group %s as rank %d/%d (%s)", group_name, rank, world_size, backend)
    return pg


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Tear ``group`` down (ignores a group that is already gone)."""
    if group is None:
        return
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError, KeyError) as e:  # already destroyed, or its peers died
        logger.debug("destroying bridge group: %s", e)


def gather_objects(value, group=None) -> list:
    """``value`` of every rank of ``group`` (the default group if None), in rank order; ``[value]``
    without torch.distributed."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def rank0_object(value, group=None):
    """Rank 0's ``value`` on every rank of ``group`` (the default group if None)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
