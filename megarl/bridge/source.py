"""The trainer side's view of its weights: this rank's Megatron shards and its coordinates.

:class:`TrainerCoords` places a rank in the layout (stage, TP / expert-TP rank, EP rank,
data-parallel replica) so it can tell which :class:`~megarl.bridge.transfer_plan.Owner` it is.
:class:`ShardSource` hands out local shards by canonical Megatron name and, for
broadcast and disk modes, gathers a parameter over its (expert) tensor-parallel group
and converts it to HF tensors with the family mapping's ``export_from_shards``.

With LoRA adapters on the actor (``actor.lora.rank > 0``, ``weight_update.lora: merged``) the
servers receive plain weights with the adapters folded in: :meth:`ShardSource.local`, the one
place every transport reads a trainer shard, hands out ``W + (alpha / r) B A`` for each adapted
weight, computed from this rank's shards in the Megatron layout (``megarl.models.lora.merged_weight``)
before any gather, conversion or resharding. The merged shards are new tensors: the trainer's
weights are never written, so nothing needs restoring after the update (or after one that failed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.bridge.transfer_plan import Owner, SourceParam
from megarl.models.mapping import ModelDims, export_from_shards


@dataclass(frozen=True)
class TrainerCoords:
    """A trainer rank's position: global rank, stage, (expert) TP rank, EP rank, DP replicas."""

    rank: int
    pp: int = 0
    tp: int = 0
    dp: int = 0
    ep: int = 0
    etp: int = 0
    edp: int = 0

    @classmethod
    def from_parallel(cls, state) -> TrainerCoords:
        """From the actor's :class:`~megarl.actor.parallel.ParallelState`."""
        return cls(
            state.rank, state.pp_rank, state.tp_rank, state.replica_rank, state.ep_rank, state.etp_rank, state.edp_rank
        )

    def holds(self, owner: Owner) -> bool:
        """Whether this rank is ``owner`` (the copy that sends)."""
        if owner.expert:
            return (self.pp, self.etp, self.ep, self.edp) == (owner.pp, owner.tp, owner.ep, owner.replica)
        return (self.pp, self.tp, self.dp) == (owner.pp, owner.tp, owner.replica)

    def gathers_for(self, owner: Owner) -> bool:
        """Whether this rank is in the (expert) TP group that gathers for broadcast sender ``owner``."""
        if owner.expert:
            return (self.pp, self.ep, self.edp) == (owner.pp, owner.ep, owner.replica)
        return (self.pp, self.dp) == (owner.pp, owner.replica)


class ShardSource:
    """This rank's shards by canonical Megatron name, and the groups to gather them over.

    Args:
        params: ``{canonical Megatron name: local shard}`` of this rank (all its chunks).
        coords: This rank's coordinates.
        dims: The model's sizes (vocab padding, heads) for the HF conversion.
        tp_group / etp_group: (Expert) tensor-parallel groups; None when of size 1.
        merged: ``{canonical name: call returning the shard to send instead}`` (LoRA: the base
            weight with its adapter merged), computed when read.
        merged_cache_bytes: How many bytes of the merged shards computed last to keep for the
            next reads (sharded mode reads a shard once per worker piece); the newest one is always kept.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        coords: TrainerCoords,
        dims: ModelDims,
        tp_group=None,
        etp_group=None,
        merged: dict[str, Callable[[], torch.Tensor]] | None = None,
        merged_cache_bytes: int = 256 * 2**20,
    ):
        self.params = params
        self.coords = coords
        self.dims = dims
        self.tp_group = tp_group
        self.etp_group = etp_group
        self.merged = merged or {}
        self.merged_cache_bytes = merged_cache_bytes
        self._cache: dict[str, torch.Tensor] = {}  # least recently read first

    @classmethod
    def from_engine(cls, engine) -> ShardSource:
        """The shards of a :class:`~megarl.actor.engine.MegatronEngine` (its model chunks); with LoRA
        adapters, each adapted weight is read merged (:func:`megarl.models.lora.merged_weights`)."""
        from megarl.models import lora
        from megarl.models.hf_io import canonical_params

        params = {}
        for chunk in engine.model:
            params.update({n: p.detach() for n, p in canonical_params(chunk, engine.coords).items()})
        p = engine.parallel
        merged = lora.merged_weights(engine.model, engine.coords)
        return cls(params, TrainerCoords.from_parallel(p), engine.desc.dims, p.tp_group, p.etp_group, merged)

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def local(self, name: str) -> torch.Tensor:
        """This rank's shard of ``name`` as the servers get it (merged with its LoRA adapter if it has
        one); KeyError naming what the rank holds if absent."""
        if name in self.merged:
            return self._merged(name)
        try:
            return self.params[name]
        except KeyError:
            raise KeyError(
                f"trainer rank {self.coords.rank} holds no shard of {name!r} "
                f"(it holds {len(self.params)} parameters, e.g. {sorted(self.params)[:3]})"
            ) from None

    def _merged(self, name: str) -> torch.Tensor:
        tensor = self._cache.pop(name, None)
        if tensor is None:
            tensor = self.merged[name]()
        self._cache[name] = tensor
        size = lambda: sum(t.numel() * t.element_size() for t in self._cache.values())
        while len(self._cache) > 1 and size() > self.merged_cache_bytes:
            del self._cache[next(iter(self._cache))]
        return tensor

    def gather_hf(self, src: SourceParam) -> dict[str, torch.Tensor]:
        """Full HF tensors of ``src`` (collective over its TP / ETP group; every member gets them)."""
        shard = self.local(src.megatron)
        group = self.etp_group if src.rule.is_expert else self.tp_group
        size = 1 if group is None else dist.get_world_size(group)
        if size == 1 or src.rule.split == "replicated":
            shards = [shard]
        else:
            shards = [torch.empty_like(shard) for _ in range(size)]
            dist.all_gather(shards, shard.contiguous(), group=group)
        return export_from_shards(src.rule, src.hf_names, shards, self.dims)
