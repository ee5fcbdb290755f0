"""How often the trainer routes a trained token to the experts the server routed it to (MoE).

With ``rollout.return_routed_experts`` the servers report, for every token and every layer, the
top-k experts of the forward that produced it (SGLang's ``return_routed_experts``, vLLM's
``--enable-return-routed-experts``); the trajectory keeps them as ``routed_experts``
``[B, S, layers * top-k]`` (token-aligned like ``logprobs``; -1 where there is none). A routing
mismatch is a train–inference gap that the logprob gap hides: the token's logprob may be close
while a different expert was trained. ``actor.routing_replay: R3`` removes it
(:mod:`megarl.actor.router_replay`); with it this share is 1 by construction.

:class:`RoutingMeter` hooks every Megatron router of the actor for the pass that measures the gap
(the recompute pass, or the update's own forward) and, over the tokens trained, counts the
(token, MoE layer) pairs whose top-k expert *sets* are equal on both sides:
``ppo_actor/gap/routing/topk_match`` (a share in [0, 1]) and ``ppo_actor/gap/routing/n_pairs``.
Each pipeline stage counts its own layers; sequence-parallel ranks their slice of the tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.actor import cpu_shim
from megarl.utils import stats_tracker

ROUTED_KEY = "routed_experts"  # in a trajectory: [B, S, layers * top-k], token-aligned, -1 where none
_SERVER_KEY = "server_routing"  # next-token aligned, as the trainer's outputs are
_MASK_KEY = "routing_mask"


def server_routes(data: dict) -> torch.Tensor | None:
    """The servers' routes of ``data`` (its token-aligned ``routed_experts``) position-aligned; None if it has none.

    ``routed_experts[b, i]`` are the experts of the forward that produced token ``i``, i.e. of
    position ``i - 1``; a position whose next token is padding (or absent) gets ``-1``.
    """
    if ROUTED_KEY not in data:
        return None
    routed = torch.roll(data[ROUTED_KEY], shifts=-1, dims=1)
    attention = data["attention_mask"].bool()
    has_next = attention & torch.roll(attention, shifts=-1, dims=1)
    has_next[:, -1] = False
    return torch.where(has_next[..., None], routed, torch.full_like(routed, -1))


def add_server_routing(data: dict, loss_mask: torch.Tensor) -> bool:
    """Align the servers' routing with the trainer's outputs (position ``t`` computes token ``t + 1``).

    ``loss_mask``: next-token aligned, ``[B, S]``. Returns whether the batch has any.
    """
    routed = server_routes(data)
    if routed is None:
        return False
    data[_SERVER_KEY] = routed
    data[_MASK_KEY] = loss_mask.bool() & (routed >= 0).all(dim=-1)
    return True


class RoutingMeter:
    """Counts top-k agreement of the trainer's routers with the servers' (see the module doc).

    The engine tells it the micro-batch each forward runs on (:meth:`set_microbatch`); every
    router's forward hook compares its routing map with that micro-batch's ``server_routing``.
    """

    def __init__(self, tp_rank: int = 0, tp_size: int = 1):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._data: dict | None = None
        self._matched = torch.zeros((), dtype=torch.float64)
        self._pairs = torch.zeros((), dtype=torch.float64)

    def set_microbatch(self, data: dict) -> None:
        self._data = data if _SERVER_KEY in data else None

    @contextlib.contextmanager
    def watching(self, model_chunks) -> Iterator[RoutingMeter]:
        """Hook the routers of ``model_chunks`` for the block."""
        from megatron.core.transformer.moe.router import Router

        handles = [
            module.register_forward_hook(self._hook)
            for chunk in model_chunks
            for module in chunk.modules()
            if isinstance(module, Router)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self._data = None

    def _hook(self, router, _inputs, outputs) -> None:
        if self._data is None:
            return
        routing_map = outputs[1]  # [tokens, experts] bool
        server, mask = self._data[_SERVER_KEY], self._data[_MASK_KEY]  # [T, layers * k], [T]
        rows = routing_map.shape[0]
        if rows != server.shape[0]:  # sequence parallel: this TP rank routes its slice of the tokens
            server, mask = (x[self.tp_rank * rows : (self.tp_rank + 1) * rows] for x in (server, mask))
        elif self.tp_rank != 0:
            return  # every TP rank routes the same tokens: count them once
        k = router.topk
        layer = router.layer_number - 1  # Megatron's global, 1-based layer number
        expected = server[:, layer * k : (layer + 1) * k].long().clamp(min=0)
        expected_map = torch.zeros_like(routing_map).scatter_(1, expected.to(routing_map.device), True)
        same = (expected_map == routing_map).all(dim=-1).cpu() & mask
        self._matched += same.sum()
        self._pairs += mask.sum()

    def finish(self) -> None:
        """Record the share over every rank's tokens and layers (a collective over the whole world)."""
        counts = torch.stack([self._matched, self._pairs])
        if dist.is_initialized():  # on the model's device: NCCL reduces CUDA tensors only
            counts = counts.to(cpu_shim.device())
            dist.all_reduce(counts)
        self._matched.zero_(), self._pairs.zero_()
        matched, pairs = counts.tolist()
        stats_tracker.scalar(**{"gap/routing/n_pairs": pairs})
        if pairs:
            stats_tracker.scalar(**{"gap/routing/topk_match": matched / pairs})
