"""MoE routing between the servers and the trainer: how often they agree, and replaying the servers' routes.

A MoE trainer and its inference servers compute the same network only if they route every
token to the same experts. They often do not: the servers run other kernels in another dtype,
and near-ties between two experts' scores fall either way. A routing mismatch is a
train–inference gap that the logprob gap hides: the token's logprob may be close while a
different expert was trained.

**The servers' routes.** With ``rollout.return_routed_experts`` the servers report, for every
token and every layer, the top-k experts of the forward that produced it (SGLang's
``return_routed_experts``, vLLM's ``--enable-return-routed-experts``); the trajectory keeps them
as ``routed_experts`` ``[B, S, layers * top-k]`` (token-aligned like ``logprobs``; -1 where there
is none). Inside the trainer they are position-aligned (:func:`server_routes`): position ``t``
holds, layer-major, the top-k experts of the forward that produces token ``t + 1``.

**Measuring** (:class:`RoutingMeter`): every Megatron router of the actor is hooked for the pass
that measures the gap (the recompute pass, or the update's own forward); over the tokens trained
it counts the (token, MoE layer) pairs whose top-k expert *sets* are equal on both sides:
``ppo_actor/gap/routing/topk_match`` (a share in [0, 1]) and ``ppo_actor/gap/routing/n_pairs``.
Each pipeline stage counts its own layers; sequence-parallel ranks their slice of the tokens, and
context-parallel ranks their chunks of each sequence.

**Replaying** (:class:`RoutingReplay`, ``actor.routing_replay``) removes the difference from the
trainer's side:

* ``R3`` (rollout routing replay): every trainer forward that scores the rollout's tokens (the
  proximal pass and the update's forward) routes each token to the top-k experts the server's
  forward routed it to; the meter's share is then 1 by construction.
* ``R2``: the proximal pass routes freely and records; the update's forwards replay that
  record, so that every mini-batch and epoch trains the network the proximal logprobs came from.

Replay goes through Megatron-Core's :class:`~megatron.core.transformer.moe.router_replay.RouterReplay`
hook in ``topk_routing_with_score_function``: the router still computes its logits, and the
replayed experts' weights are the router's own scores at those experts (softmax over the
chosen top-k's logits for Qwen3-MoE), so the router's weights keep their gradients. A token
without a route (a prompt token the server did not report, the last token of a sequence,
a multi-turn prompt the server never saw) takes the router's own choice;
``ppo_actor/routing_replay/replayed_share`` says which share of (token, MoE layer) pairs was
replayed. The load-balancing loss (``megatron.moe_router_load_balancing_type: aux_loss``, off by
default in RL) is computed from the router's own top-k, not the replayed one, as Megatron defines it.
Megatron numbers its MoE layers globally, so each pipeline stage replays its own; under context
parallelism each rank replays the routes of its chunks (``megarl.actor.context_parallel``).

Both are micro-batch hooks of the engine (``MegatronEngine.microbatch_hooks``): told each packed
micro-batch before a model chunk's forward (``before_forward``) and after it (``after_forward``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megarl.actor import cpu_shim
from megarl.actor.packing import MicroBatch
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

    A micro-batch hook of the engine: told the micro-batch each forward runs on (:meth:`before_forward`),
    every router's forward hook compares its routing map with that micro-batch's ``server_routing``.
    """

    def __init__(self, tp_rank: int = 0, tp_size: int = 1):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._data: dict | None = None
        self._matched = torch.zeros((), dtype=torch.float64)
        self._pairs = torch.zeros((), dtype=torch.float64)

    def before_forward(self, chunk, mb: MicroBatch) -> None:
        """The micro-batch's servers' routes and mask, of the tokens this rank's model sees."""
        self._data = None
        if _SERVER_KEY in mb.data:
            self._data = {key: _model_tokens(mb, mb.data[key]) for key in (_SERVER_KEY, _MASK_KEY)}

    def after_forward(self, chunk, mb: MicroBatch) -> None:
        pass

    @contextlib.contextmanager
    def watching(self, model_chunks) -> Iterator[RoutingMeter]:
        """Hook the routers of ``model_chunks`` for the block."""
        handles = [router.register_forward_hook(self._hook) for chunk in model_chunks for router in _routers(chunk)]
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


def _model_tokens(mb: MicroBatch, stream: torch.Tensor) -> torch.Tensor:
    """A per-token tensor of ``mb``'s packed stream restricted to the tokens the model runs on here: all
    of them, or this context-parallel rank's (padding: 0 / False)."""
    return stream if mb.context is None else mb.context.local(stream)


REPLAY_KEY = "replay_routes"  # [B, S, layers * top-k], position-aligned, -1 where the router chooses itself
REPLAY_MODES = ("none", "R2", "R3")


class TokenRouterReplay(RouterReplay):
    """Megatron's :class:`RouterReplay` for one router, per token: a token with a route (every id
    >= 0) is sent to those experts, any other to the router's own top-k.

    Unlike Megatron's own instances it is not listed in ``RouterReplay``'s process-wide registry:
    megarl sets each model's routers itself (an actor and a reference model may share a process).
    With activation recompute (``checkpointed``), the forward under ``no_grad`` queues its targets
    for the backward's recompute of the same micro-batch, which takes them in order.
    """

    def __init__(self):  # noqa: D107 - the registry is RouterReplay.__init__'s only other effect
        self.target_topk_idx: torch.Tensor | None = None
        self.recorded_topk_idx: torch.Tensor | None = None
        self.router_replay_action: RouterReplayAction | None = None
        self.replay_backward_list: list[torch.Tensor] = []
        self.checkpointed = False
        self.tokens: torch.Tensor | None = None  # which rows of the target are tokens (not packing's padding)
        self.counts = torch.zeros(3, dtype=torch.float64)  # replayed, own, agreed: see _count (first forwards)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        action = self.router_replay_action
        if action == RouterReplayAction.RECORD:
            self.record_indices(own.detach())
        if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            return values, own
        recompute = self.checkpointed and torch.is_grad_enabled() and bool(self.replay_backward_list)
        target = self.replay_backward_list.pop(0) if recompute else self.target_topk_idx
        if target is None:
            return values, own
        target = target.to(own.device)
        given = (target >= 0).all(dim=-1, keepdim=True)
        if not recompute:
            self._count(target, given[:, 0], own)
            if self.checkpointed and not torch.is_grad_enabled():  # the backward's recompute will want it
                self.replay_backward_list.append(target)
        indices = torch.where(given, target.clamp(min=0).to(own.dtype), own)
        return scores.gather(1, indices), indices

    def _count(self, target: torch.Tensor, given: torch.Tensor, own: torch.Tensor) -> None:
        """Tokens replayed, tokens routed by the router itself, and replayed tokens whose own top-k set is the
        replayed one (what the router would have agreed to); kept on the device (no host sync per forward)."""
        tokens = self.tokens.to(given.device) if self.tokens is not None else torch.ones_like(given)
        same = (own.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1)
        replayed, agreed = (given & tokens).sum(), (given & tokens & same).sum()
        counts = torch.stack([replayed, tokens.sum() - replayed, agreed]).double()
        self.counts = self.counts.to(counts.device) + counts


def _routers(chunk) -> list:
    return [m for m in chunk.modules() if isinstance(m, Router)]


class RoutingReplay:
    """Replays (or records) the routing of every router of an engine's model chunks, one micro-batch at a time.

    ``mode`` is ``actor.routing_replay`` (``R2`` or ``R3``). The actor frames its passes with
    :meth:`proximal_pass` and :meth:`update`; the engine calls :meth:`before_forward` with each
    micro-batch (packed ``data``) before a model chunk's forward and :meth:`after_forward` after it.
    ``checkpointed``: the update's forwards recompute activations in backward (``recompute: full``).
    """

    def __init__(self, mode: str, model_chunks, tp_rank: int, tp_group, sequence_parallel: bool, checkpointed: bool):
        if mode not in REPLAY_MODES[1:]:
            raise ValueError(f"actor.routing_replay={mode!r}: expected one of {list(REPLAY_MODES[1:])}")
        self.mode, self.checkpointed = mode, checkpointed
        self.tp_rank, self.tp_group, self.sequence_parallel = tp_rank, tp_group, sequence_parallel
        self._chunk_routers = {id(chunk): _routers(chunk) for chunk in model_chunks}  # looked up per micro-batch
        self.routers = [r for routers in self._chunk_routers.values() for r in routers]
        for router in self.routers:
            if router.config.moe_router_fusion or router.routing_type == "sinkhorn":
                raise ValueError(
                    "actor.routing_replay: the router's fused top-k (moe_router_fusion) and sinkhorn routing "
                    "bypass Megatron's RouterReplay"
                )
            router.router_replay = TokenRouterReplay()
        self.n_layers = max((r.layer_number for r in self.routers), default=0)  # this stage's last, global
        self.action: RouterReplayAction | None = None
        self.record: torch.Tensor | None = None

    @contextlib.contextmanager
    def proximal_pass(self, data: dict) -> Iterator[None]:
        """The proximal (old-logprob) pass over ``data``: R3 replays the servers' routes; R2 records the
        routing into ``data["replay_routes"]`` for :meth:`update`."""
        if self.mode == "R2":
            with self.recording(*data["attention_mask"].shape):
                yield
            data[REPLAY_KEY] = self.record
            return
        routes = server_routes(data)
        if routes is not None:
            data[REPLAY_KEY] = self._checked(routes)
        with self.replaying(checkpointed=False):
            yield

    @contextlib.contextmanager
    def update(self, data: dict) -> Iterator[None]:
        """The update's forwards over ``data`` replay its ``replay_routes`` (R3: the servers' routes)."""
        if self.mode == "R3" and REPLAY_KEY not in data:
            routes = server_routes(data)
            if routes is not None:
                data[REPLAY_KEY] = self._checked(routes)
        with self.replaying(self.checkpointed):
            yield

    def _checked(self, routes: torch.Tensor) -> torch.Tensor:
        """The servers' routes, or a ValueError when they cannot be this model's: the wrong number of layers x
        top-k, or an expert id it does not have (a server serving another model)."""
        if not self.routers:
            return routes
        config, k = self.routers[0].config, self.routers[0].topk
        width = config.num_layers * k
        if routes.shape[-1] != width:
            raise ValueError(
                f"routed_experts: {routes.shape[-1]} ids per token, but the actor's model routes "
                f"{config.num_layers} layers x top-{k} = {width} (does the server serve the actor's model?)"
            )
        top = int(routes.max()) if routes.numel() else -1
        if top >= config.num_moe_experts:
            raise ValueError(
                f"routed_experts: expert {top}, but the actor's model has {config.num_moe_experts} experts "
                "(does the server serve the actor's model?)"
            )
        return routes

    @contextlib.contextmanager
    def replaying(self, checkpointed: bool) -> Iterator[None]:
        """Replay ``data[REPLAY_KEY]`` (packed with each micro-batch) in the forwards of the block."""
        with self._action(RouterReplayAction.REPLAY_FORWARD, checkpointed):
            yield

    @contextlib.contextmanager
    def recording(self, batch_size: int, seq_len: int) -> Iterator[None]:
        """Record every router's own top-k in the forwards of the block over a ``[batch_size, seq_len]``
        batch: :attr:`record` is ``[B, S, layers * top-k]``, -1 at padding and at other stages' layers."""
        width = self.n_layers * (self.routers[0].topk if self.routers else 0)
        self.record = torch.full((batch_size, seq_len, width), -1, dtype=torch.int16)
        with self._action(RouterReplayAction.RECORD, checkpointed=False):
            yield

    @contextlib.contextmanager
    def _action(self, action: RouterReplayAction, checkpointed: bool) -> Iterator[None]:
        self.action = action
        for router in self.routers:
            router.router_replay.set_router_replay_action(action)
            router.router_replay.checkpointed = checkpointed
            router.router_replay.counts.zero_()
        try:
            yield
        finally:
            self.action = None
            for router in self.routers:
                router.router_replay.clear_router_replay_action()
                router.router_replay.clear_indices()

    # ------------------------------------------------------------------ micro-batches

    def before_forward(self, chunk, mb: MicroBatch) -> None:
        """Give ``chunk``'s routers their part of the micro-batch's routes (replaying only)."""
        if self.action != RouterReplayAction.REPLAY_FORWARD:
            return
        tokens = _model_tokens(mb, mb.data["attention_mask"].bool())  # padding (packing's, CP's) routes itself
        routes = mb.data.get(REPLAY_KEY)
        if routes is not None:
            routes = self._local_slice(torch.where(tokens[:, None], _model_tokens(mb, routes.long()), -1))
        tokens = self._local_slice(tokens)
        for router in self._chunk_routers[id(chunk)]:
            k, layer = router.topk, router.layer_number - 1
            router.router_replay.target_topk_idx = None if routes is None else routes[:, layer * k : (layer + 1) * k]
            router.router_replay.tokens = tokens

    def after_forward(self, chunk, mb: MicroBatch) -> None:
        """Write ``chunk``'s recorded top-k for micro-batch ``mb`` into :attr:`record` (recording only)."""
        if self.action != RouterReplayAction.RECORD:
            return
        for router in self._chunk_routers[id(chunk)]:
            recorded = self._full_sequence(router.router_replay.recorded_topk_idx)
            if mb.context is not None:  # every context-parallel rank's tokens, in the packed stream
                recorded = mb.context.gather(recorded.long())
            recorded = recorded.to(torch.int16).cpu()
            k, layer = router.topk, router.layer_number - 1
            offset = 0
            for segment in mb.segments:  # a shared prefix's routes go to every row it stands for
                for row in segment.rows:
                    self.record[row, segment.start : segment.end, layer * k : (layer + 1) * k] = recorded[
                        offset : offset + segment.length
                    ]
                offset += segment.length

    def _local_slice(self, target: torch.Tensor) -> torch.Tensor:
        """Sequence parallel: this TP rank routes its contiguous slice of the micro-batch's tokens."""
        if not self.sequence_parallel:
            return target
        rows = target.shape[0] // dist.get_world_size(self.tp_group)
        return target[self.tp_rank * rows : (self.tp_rank + 1) * rows]

    def _full_sequence(self, local: torch.Tensor) -> torch.Tensor:
        """Sequence parallel: the whole micro-batch's routes from every TP rank's slice."""
        if not self.sequence_parallel:
            return local
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.tp_group))]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return torch.cat(parts)

    # ------------------------------------------------------------------ statistics

    def finish(self) -> None:
        """Record, over every rank (a world collective), the share of (token, MoE layer) routes replayed and the
        share of replayed routes the router would have chosen itself (``own_match``: 1 - what replay changed)."""
        counts = torch.zeros(3, dtype=torch.float64)
        for router in self.routers:
            counts += router.router_replay.counts.cpu()
            router.router_replay.counts.zero_()
        if not self.sequence_parallel and self.tp_rank != 0:
            counts.zero_()  # every TP rank routed the same tokens: count them once
        if dist.is_initialized():  # on the model's device: NCCL reduces CUDA tensors only
            counts = counts.to(cpu_shim.device())
            dist.all_reduce(counts)
        replayed, own, agreed = counts.tolist()
        if replayed + own:
            stats_tracker.scalar(**{"routing_replay/replayed_share": replayed / (replayed + own)})
        if replayed:
            stats_tracker.scalar(**{"routing_replay/own_match": agreed / replayed})
