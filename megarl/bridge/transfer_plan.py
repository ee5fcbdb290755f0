"""The transfer plan: who sends which piece of which weight to which inference worker.

Pure functions of the model (HF config, HF tensor shapes, family mapping), the trainer
layout (TP, PP, VPP, EP, ETP, DP) and the inference layout (servers and their TP); no
processes. Both sides of a transfer derive their schedule from one :class:`TransferPlan`.

Source side (Megatron). Every canonical Megatron parameter has an owner: its pipeline
stage and virtual chunk (from its layer), its expert-parallel rank (experts), and per
(expert-)tensor-parallel rank a local shard. Which HF rows a local shard holds is *not*
re-described here: :func:`source_index` runs the family mapping's own
:func:`~megarl.models.mapping.load_shard` on tensors of row numbers instead of weights,
so vocab padding, fused QKV with GQA grouping and fused gate/up come out exactly as the
actor lays them out.

Target side: :class:`~megarl.bridge.target_layout.VLLMLayout` says which HF rows each
worker ``(server s, TP rank r)`` holds. Matching the two gives, per worker, a list of
:class:`Piece` s: contiguous runs copied from one trainer rank's shard into one local
tensor. Bytes per worker are then the worker's share of the model (sharded mode).

Every server of one TP size holds the same slices, so the local tensors and pieces are
computed once per (server TP size, TP rank) and shared by all such workers (the same list
objects): a piece names its shard's replica 0, and which data-parallel replica sends it to a
given worker is :meth:`TransferPlan.sender` (``server % replicas``, spreading the servers over
the trainer's copies). Planning is then O(model x distinct TP ranks + workers), not O(model x
workers): 1,024 workers of a 30B MoE cost what 4 do.

Broadcast mode instead lists, per sender (pipeline stage x expert-parallel rank), the
full HF tensors it gathers over TP / ETP and broadcasts to every worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from megarl.bridge.target_layout import LocalTensor, VLLMLayout
from megarl.config.allocation import TrainingAllocation
from megarl.models.mapping import ModelDims, ParamRule, load_shard

Mode = Literal["broadcast", "sharded", "disk"]
MODES = ("broadcast", "sharded", "disk")
_STRIDE = 1 << 32  # code = hf_index * _STRIDE + row + 1; 0 marks padding rows


@dataclass(frozen=True)
class Owner:
    """Trainer coordinates of one shard: stage, (expert-)TP rank, EP rank, replica."""

    pp: int
    tp: int
    """TP rank, or expert-TP rank for expert parameters."""
    ep: int = 0
    expert: bool = False
    replica: int = 0
    """DP rank (dense) or expert-DP rank (experts) of the copy that sends."""


@dataclass(frozen=True)
class SourceParam:
    """One canonical Megatron parameter and where it lives."""

    megatron: str
    rule: ParamRule
    hf_names: tuple[str, ...]
    pp: int
    chunk: int
    """Virtual pipeline chunk on its stage."""
    ep: int = 0
    """Expert-parallel rank holding it (experts)."""


@dataclass(frozen=True)
class Piece:
    """Copy ``length`` rows along ``dim`` from the owner's shard of ``src`` into a worker's tensor.

    ``dim`` None: the whole tensor. Rows are counted along ``dim`` of the local tensor
    (after indexing ``expert``); every other dim is taken whole.
    """

    dest: str
    expert: int | None
    dim: int | None
    dest_start: int
    length: int
    src: str
    src_start: int
    owner: Owner
    """The shard it is cut from, as its replica 0 (every replica holds the same rows):
    :meth:`TransferPlan.sender` names the replica that sends it to a given worker."""
    numel: int


@dataclass
class TransferPlan:
    """Everything both sides need: sources, per-worker local tensors and pieces, broadcast lists."""

    trainer: TrainingAllocation
    server_tp: tuple[int, ...]
    sources: list[SourceParam]
    hf_shapes: dict[str, tuple[int, ...]]
    local: dict[int, list[LocalTensor]] = field(default_factory=dict)
    """Per worker index: the tensors it holds (vLLM layout); one list shared by the workers of
    equal (server TP size, TP rank)."""
    pieces: dict[int, list[Piece]] = field(default_factory=dict)
    """Per worker index: what it receives in sharded mode, in send order; one list shared like
    ``local`` (owners as replica 0: :meth:`sender`)."""

    @property
    def workers(self) -> list[tuple[int, int]]:
        """(server, TP rank) of every inference worker, in worker-index order."""
        return [(s, r) for s, tp in enumerate(self.server_tp) for r in range(tp)]

    def sender(self, worker: int, owner: Owner) -> Owner:
        """The replica of ``owner`` (a piece's owner) that sends to ``worker``: ``server % replicas``."""
        server = self._server_of[worker]
        replicas = self.trainer.edp if owner.expert else self.trainer.dense_replicas
        return dataclasses.replace(owner, replica=server % replicas)

    def __post_init__(self):
        self._server_of = [s for s, tp in enumerate(self.server_tp) for _ in range(tp)]

    def worker_index(self, server: int, rank: int) -> int:
        return sum(self.server_tp[:server]) + rank

    def hf_tensors(self) -> list[tuple[str, SourceParam]]:
        """Exported HF tensors in model order with their source parameter."""
        return [(n, s) for s in self.sources if s.rule.export for n in s.hf_names]

    def model_numel(self) -> int:
        return sum(math.prod(self.hf_shapes[n]) for n, _ in self.hf_tensors())

    def broadcast_senders(self) -> dict[Owner, list[SourceParam]]:
        """Broadcast mode: per sender (replica 0, TP rank 0 of its stage / expert shard), its parameters."""
        out: dict[Owner, list[SourceParam]] = {}
        for src in self.sources:
            if src.rule.export:
                expert = src.rule.is_expert
                out.setdefault(Owner(src.pp, 0, src.ep if expert else 0, expert, 0), []).append(src)
        return out

    def worker_numel(self, worker: int) -> int:
        return sum(p.numel for p in self.pieces[worker])


# ---------------------------------------------------------------------------------------
# source side
# ---------------------------------------------------------------------------------------


def enumerate_sources(mapping, hf_config, trainer: TrainingAllocation) -> list[SourceParam]:
    """Every canonical Megatron parameter of the model, in model order, with its owner."""
    num_layers = hf_config.num_hidden_layers
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0
    last = (trainer.pp - 1, trainer.vpp - 1)
    head = [r for r in mapping.rules if "{layer}" not in r.megatron and r.megatron.startswith("embedding.")]
    tail = [r for r in mapping.rules if "{layer}" not in r.megatron and not r.megatron.startswith("embedding.")]
    layered = [r for r in mapping.rules if "{layer}" in r.megatron]
    out = [SourceParam(r.megatron, r, r.hf_names(), 0, 0) for r in head]
    for layer in range(num_layers):
        pp, chunk = trainer.place_layer(layer, num_layers)
        for rule in layered:
            if not rule.is_expert:
                out.append(SourceParam(rule.megatron.format(layer=layer), rule, rule.hf_names(layer=layer), pp, chunk))
                continue
            if num_experts % trainer.ep:
                raise ValueError(f"{num_experts} experts do not split over expert parallel size {trainer.ep}")
            for expert in range(num_experts):
                name = rule.megatron.format(layer=layer, expert=expert)
                ep = expert // (num_experts // trainer.ep)
                out.append(SourceParam(name, rule, rule.hf_names(layer=layer, expert=expert), pp, chunk, ep))
    out += [SourceParam(r.megatron, r, r.hf_names(), *last) for r in tail]
    return out


def split_dim(rule: ParamRule) -> int | None:
    """The dim a rule splits over (expert-)TP ranks; None when replicated."""
    return None if rule.split == "replicated" else 1 if rule.split == "row" else 0


def source_index(
    rule: ParamRule, hf_ids: dict[str, int], shapes: dict[str, tuple[int, ...]], rank: int, size: int, dims: ModelDims
) -> torch.Tensor:
    """Codes of the rows of TP rank ``rank``'s shard along its split dim (``hf_id * 2**32 + row + 1``; 0: padding).

    Computed by the mapping's own ``load_shard`` applied to row numbers, so it is the
    layout the actor loads and exports.
    """
    dim = split_dim(rule)

    def index(name: str) -> torch.Tensor:
        n = shapes[name][dim or 0]
        codes = hf_ids[name] * _STRIDE + torch.arange(1, n + 1, dtype=torch.int64)
        return codes.reshape(1, n) if dim == 1 else codes.reshape(n, 1)

    def read(name, d, start, stop):
        full = index(name)
        return full if d is None else full.narrow(d, start, stop - start)

    ordered = list(hf_ids)
    first = index(ordered[0])
    shard = load_shard(rule, tuple(ordered), read, tuple(first.shape), rank, size, dims)
    return shard.flatten().to(torch.int64)  # a padding-only vocab shard comes back as float zeros


@dataclass
class _RowOwners:
    """Per HF tensor: the TP rank and local row of each of its rows (None: replicated)."""

    tp: torch.Tensor | None
    pos: torch.Tensor | None


def _row_owners(src: SourceParam, shapes, size: int, dims: ModelDims) -> dict[str, _RowOwners]:
    if src.rule.split == "replicated":
        return {n: _RowOwners(None, None) for n in src.hf_names}
    ids = {n: i for i, n in enumerate(src.hf_names)}
    dim = split_dim(src.rule)
    tps = {n: torch.full((shapes[n][dim],), -1, dtype=torch.int64) for n in src.hf_names}
    pos = {n: torch.full((shapes[n][dim],), -1, dtype=torch.int64) for n in src.hf_names}
    for rank in range(size):
        codes = source_index(src.rule, ids, shapes, rank, size, dims)
        real = torch.nonzero(codes).flatten()
        hf_id, rows = (codes[real] - 1) // _STRIDE, (codes[real] - 1) % _STRIDE
        for name, i in ids.items():
            sel = hf_id == i
            tps[name][rows[sel]] = rank
            pos[name][rows[sel]] = real[sel]
    for name in src.hf_names:
        if bool((tps[name] < 0).any()):
            raise AssertionError(f"{src.megatron}: rows of {name} owned by no TP rank")
    return {n: _RowOwners(tps[n], pos[n]) for n in src.hf_names}


# ---------------------------------------------------------------------------------------
# matching
# ---------------------------------------------------------------------------------------


def _runs(dest_start: int, tp: torch.Tensor, pos: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Maximal runs (dest_start, length, tp, src_start) where owner is constant and rows are consecutive."""
    if tp.numel() == 0:
        return []
    breaks = torch.nonzero((tp[1:] != tp[:-1]) | (pos[1:] != pos[:-1] + 1)).flatten() + 1
    bounds = [0, *breaks.tolist(), tp.numel()]
    return [(dest_start + a, b - a, int(tp[a]), int(pos[a])) for a, b in itertools.pairwise(bounds)]


def _pieces_for(
    local: LocalTensor,
    src: SourceParam,
    owners: dict[str, _RowOwners],
    owner_of,
    worker_rank: int,
    size: int,
    runs: dict | None = None,
) -> list[Piece]:
    """``runs``: a memo of :func:`_runs` per (row table, segment) (tables are shared by the
    parameters of one rule and shape, e.g. every expert's)."""
    pieces, offset = [], 0
    for seg in local.segments:
        if seg.hf is None:  # padding rows: the receiver zero-fills them
            offset += seg.length
            continue
        rows = owners[seg.hf]
        if local.dim is None:
            if rows.tp is not None:
                raise ValueError(f"{seg.hf}: split by the trainer but replicated on the server")
            pieces.append(
                Piece(
                    local.name,
                    local.expert,
                    None,
                    0,
                    seg.length,
                    src.megatron,
                    0,
                    owner_of(worker_rank % size),
                    math.prod(local.shape),
                )
            )
            continue
        if rows.tp is None:  # replicated by the trainer: one run from this rank's copy
            found = [(0, seg.length, worker_rank % size, seg.start)] if seg.length else []
        else:
            if split_dim(src.rule) != local.dim:
                raise ValueError(
                    f"{seg.hf}: split along dim {split_dim(src.rule)} by the trainer, {local.dim} by the server"
                )
            key = (id(rows), seg.start, seg.stop)
            found = runs.get(key) if runs is not None else None
            if found is None:
                found = _runs(0, rows.tp[seg.start : seg.stop], rows.pos[seg.start : seg.stop])
                if runs is not None:
                    runs[key] = found
        row = math.prod(local.shape) // local.shape[local.dim]  # elements per row along dim
        for at, length, t, src_start in found:
            start, numel = offset + at, row * length
            pieces.append(
                Piece(local.name, local.expert, local.dim, start, length, src.megatron, src_start, owner_of(t), numel)
            )
        offset += seg.length
    return pieces


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection inside (also as a decorator). Planning allocates hundreds of
    thousands of objects that form no cycles; full collections triggered midway would walk every
    object of the process (the trainer's model and imports too) several times, more than the
    planning itself costs."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@functools.cache
def _owner(pp: int, tp: int, ep: int, expert: bool) -> Owner:
    """The owner of a piece: its shard's replica 0 (one object per shard)."""
    return Owner(pp, tp, ep, expert, 0)


@gc_paused()
def build_plan(
    desc,
    hf_shapes: dict[str, tuple[int, ...]],
    trainer: TrainingAllocation,
    server_tp: tuple[int, ...] | list[int],
    sharded: bool = True,
) -> TransferPlan:
    """The plan for ``desc`` (a :class:`~megarl.models.build.ModelDesc` built with the trainer's TP).

    ``hf_shapes``: shapes of the HF checkpoint's tensors (e.g. ``SafetensorsReader.shape``).
    ``server_tp``: TP size of each inference server. ``sharded``: also compute the pieces
    of sharded mode (broadcast and disk modes need only the sources).
    """
    if not server_tp:
        raise ValueError("build_plan: no inference servers")
    if desc.dims.padded_vocab_size % trainer.tp:
        raise ValueError(
            f"padded vocabulary {desc.dims.padded_vocab_size} is not a multiple of trainer tp {trainer.tp}"
        )
    sources = enumerate_sources(desc.mapping, desc.hf_config, trainer)
    shapes = {n: tuple(hf_shapes[n]) for s in sources if s.rule.export for n in s.hf_names}
    plan = TransferPlan(trainer, tuple(server_tp), sources, shapes)
    if not sharded:
        return plan
    layouts = {
        tp: VLLMLayout(
            desc.dims.num_attention_heads, desc.dims.num_query_groups, desc.dims.head_dim, desc.dims.vocab_size, tp
        )
        for tp in set(server_tp)
    }
    tables, computed = [], {}
    for src in sources:
        if src.rule.export:
            size = trainer.expert_tp if src.rule.is_expert else trainer.tp
            key = (src.rule, tuple(shapes[n] for n in src.hf_names), size)  # equal for every layer / expert
            if key not in computed:
                computed[key] = list(_row_owners(src, shapes, size, desc.dims).values())
            shard_owners = tuple(_owner(src.pp, t, src.ep, src.rule.is_expert) for t in range(size))
            tables.append((src, size, dict(zip(src.hf_names, computed[key])), shard_owners.__getitem__))
    runs: dict = {}
    first: dict[tuple[int, int], int] = {}
    for worker, (server, rank) in enumerate(plan.workers):
        twin = first.setdefault((server_tp[server], rank), worker)  # the first worker of this TP size and rank
        if twin != worker:
            plan.local[worker], plan.pieces[worker] = plan.local[twin], plan.pieces[twin]
            continue
        layout = layouts[server_tp[server]]
        plan.local[worker], plan.pieces[worker] = [], []
        for src, size, owners, owner_of in tables:
            for local in layout.local_tensors(src.rule, src.hf_names, shapes, rank):
                plan.local[worker].append(local)
                plan.pieces[worker] += _pieces_for(local, src, owners, owner_of, rank, size, runs)
    return plan
