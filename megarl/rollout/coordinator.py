"""DistRolloutCoordinator: rollout batches for an SPMD trainer.

Only data-parallel heads (tensor-, pipeline- and context-rank 0 of each DP rank) hold a rollout
engine and drive its pool, each over its own shard of the prompts. A training batch is
then made whole across the trainer:

1. every head takes ``batch_size / dp`` accepted groups from its pool;
2. the heads exchange their groups and re-split them so that every DP rank gets the
   same number of whole groups (GRPO normalises within a group, so a group is never cut)
   with balanced token counts (longest groups first, each to the lightest rank);
3. each head broadcasts its share to the other ranks of its model-parallel group
   (TP x PP peers need the very same data), through its context-parallel peers first when
   sequences are split over CP ranks (they too train on the very same rows).

When no server can take requests because the launcher restarted them and they wait for the
trainer's weights, a head stops waiting; every rank learns it through the same exchanges and
calls ``readmit()`` (collective: the weight sync pushes the current weights to those servers),
then gathering goes on, nothing gathered lost.

Process groups are passed in explicitly; nothing here knows about the actor.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.api.trajectory import concat_padded_tensors


@dataclass(frozen=True)
class DataParallelLayout:
    """Where this rank sits for data distribution."""

    dp_rank: int
    dp_size: int
    is_head: bool
    """Drives a rollout pool (tensor-, pipeline- and context-rank 0 of its DP rank)."""
    head_group: Any = None
    """Group of all DP heads (the heads' data-parallel group); None in a one-rank DP."""
    mp_group: Any = None
    """This rank's model-parallel group (TP x PP peers); None when it is this rank alone."""
    mp_src: int = 0
    """Global rank of the TP 0, PP 0 rank of ``mp_group`` (the broadcast source in it)."""
    cp_group: Any = None
    """The context-parallel peers of a TP 0, PP 0 rank (they split the same sequences); None elsewhere
    and without context parallelism."""
    cp_src: int = 0
    """Global rank of this DP rank's head (the broadcast source in ``cp_group``)."""

    @classmethod
    def from_parallel(cls, parallel) -> DataParallelLayout:
        """From a trainer's :class:`~megarl.actor.parallel.ParallelState`."""
        alloc = parallel.alloc
        mp_first = parallel.tp_rank == 0 and parallel.pp_rank == 0
        mp_group = parallel.groups.mp if alloc.tp * alloc.pp > 1 else None
        mp_src = dist.get_global_rank(mp_group, 0) if mp_group is not None else parallel.rank
        head_group = parallel.data_group if alloc.dp > 1 else None
        cp_group = parallel.cp_group if alloc.cp > 1 and mp_first else None
        cp_src = dist.get_global_rank(cp_group, 0) if cp_group is not None else parallel.rank
        is_head = mp_first and parallel.cp_rank == 0
        return cls(parallel.dp_rank, alloc.dp, is_head, head_group, mp_group, mp_src, cp_group, cp_src)


class DistRolloutCoordinator:
    """``prepare_batch`` / ``rollout_batch`` of a rollout engine, made collective over the trainer.

    Args:
        rollout: The rollout engine (DP heads only; None elsewhere).
        layout: This rank's :class:`DataParallelLayout`.
        granularity: Rows per group (AReaL's name; the config's ``actor.group_size``, i.e.
            ``gconfig.n_samples`` x ``workflow.group_size``); batches are re-split on group boundaries.
            Not the engine's ``group_size``, which counts the workflow's runs per item.
    """

    def __init__(self, rollout, layout: DataParallelLayout, granularity: int):
        if layout.is_head and rollout is None:
            raise ValueError("a data-parallel head needs a rollout engine")
        self.rollout, self.layout, self.granularity = rollout, layout, granularity

    def prepare_batch(
        self,
        dataloader: Iterable | None,
        workflow,
        should_accept_fn: Callable[[dict], bool] | None = None,
        progress: Callable[[int], None] | None = None,
        readmit: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """This rank's share of the next training batch (collective over the trainer).

        ``progress(n)``: called on the heads with the accepted episodes gathered so far.
        ``readmit()``: called on every rank (collective) when no server can take requests until the
        trainer has pushed its weights to restarted ones (see the module doc).
        """
        local = None
        while True:
            if self.layout.is_head:
                if local is None:
                    extra = {"interrupt": self.rollout.readmit_due} if readmit is not None else {}
                    local = self.rollout.prepare_batch(
                        dataloader, workflow, should_accept_fn, progress=progress, **extra
                    )
                share = self._rebalance(local)
            share = self._broadcast_in_mp(share if self.layout.is_head else None)
            if share is not _READMIT:
                return share
            readmit()

    def _rebalance(self, local: dict[str, Any] | None) -> dict[str, Any] | object:
        """Exchange groups between DP heads; return this head's balanced share (``_READMIT`` if a head
        stopped for restarted servers: a head whose batch is whole keeps it for the next round)."""
        if self.layout.head_group is None:
            return _READMIT if local is None else local
        everyone: list = [None] * self.layout.dp_size
        mine = None if local is None else split_groups(local, self.granularity)
        dist.all_gather_object(everyone, mine, group=self.layout.head_group)
        if any(head is None for head in everyone):
            return _READMIT
        groups = [g for head in everyone for g in head]
        shares = balance_groups([int(g["attention_mask"].sum()) for g in groups], self.layout.dp_size)
        return concat_padded_tensors([groups[i] for i in shares[self.layout.dp_rank]])

    def _broadcast_in_mp(self, batch: dict[str, Any] | object | None) -> dict[str, Any] | object:
        """The head's share on every rank of its DP rank: to its CP peers, then each to its TP x PP peers."""
        batch = _broadcast(batch, self.layout.cp_group, self.layout.cp_src)
        return _broadcast(batch, self.layout.mp_group, self.layout.mp_src)


def _broadcast(batch: dict[str, Any] | object | None, group, src: int) -> dict[str, Any] | object | None:
    if group is None:
        return batch
    box = [_READMIT_WIRE if batch is _READMIT else batch]
    dist.broadcast_object_list(box, src=src, group=group)
    return _READMIT if box[0] == _READMIT_WIRE else box[0]


_READMIT = object()  # a head stopped gathering: push the weights to restarted servers first
_READMIT_WIRE = "megarl:readmit"  # the same, through a broadcast (which pickles)


def split_groups(batch: dict[str, Any], granularity: int) -> list[dict[str, Any]]:
    """Cut a batch into its groups of ``granularity`` consecutive rows."""
    rows = batch["attention_mask"].shape[0]
    if rows % granularity:
        raise ValueError(f"a batch of {rows} rows is not made of whole groups of {granularity}")
    out = []
    for start in range(0, rows, granularity):
        group = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
                group[key] = value[start : start + granularity]
            elif isinstance(value, list) and len(value) == rows:
                group[key] = value[start : start + granularity]
            else:
                group[key] = value
        out.append(group)
    return out


def balance_groups(tokens: list[int], n_ranks: int) -> list[list[int]]:
    """Assign groups (their token counts) to ``n_ranks`` ranks: equal counts, balanced tokens.

    Longest first, each to the rank with the fewest tokens that still has room; the
    result is the same on every rank (ties break by index) and each rank's groups keep
    their original order.
    """
    if len(tokens) % n_ranks:
        raise ValueError(f"{len(tokens)} groups cannot be split evenly over {n_ranks} data-parallel ranks")
    room = len(tokens) // n_ranks
    heap = [(0, rank) for rank in range(n_ranks)]
    shares: list[list[int]] = [[] for _ in range(n_ranks)]
    for index in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        load, rank = heapq.heappop(heap)
        shares[rank].append(index)
        if len(shares[rank]) < room:
            heapq.heappush(heap, (load + tokens[index], rank))
    return [sorted(share) for share in shares]
