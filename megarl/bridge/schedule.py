"""Buckets: the transfer plan cut into messages of at most ``bucket_bytes``, in a fixed order.

Both sides derive the same schedule: the trainer from the plan, the receivers from the
JSON form the trainer hands them at initialisation (:func:`receiver_spec`), so every
message's layout (which tensors, which pieces, in which order, how many elements) is
known on both ends before a byte moves and nothing but raw buckets crosses the wire.

* Broadcast: per sender (a pipeline stage, or an expert shard of one), its parameters in
  model order, cut into buckets of whole parameters (the gather unit).
* Sharded: per (sender, worker) pair, its pieces in plan order, cut into buckets;
  bucket ``k`` of every pair forms round ``k`` (one batch of point-to-point messages).

Every message is one flat buffer of the wire dtype: its items back to back.

A connect builds each schedule once (O(pieces of the plan's distinct lists + pairs log
pairs); workers of one server TP size and rank share their lists) and every worker's spec
from it (:class:`ReceiverSpecs`).

What a receiver is told (JSON; :func:`receiver_spec`, one worker's *plain* spec):

* broadcast: ``{"mode": "broadcast", "senders": S, "buckets": [per sender: [per bucket:
  [[HF name, shape], ...]]]}``, the same for every worker;
* sharded: ``{"mode": "sharded", "senders": S, "sender_ranks": [group rank of each
  sender], "tensors": [[local name, expert or null, shape, [[start, stop] padding rows]],
  ...], "rounds": [per round: [[sender, [[tensor slot, dim or null, dest start, length],
  ...]], ...]]}``.

A server's init body (``WeightBridge._init_info``) carries them *packed*:
``"specs": {str(TP rank): {mode: packed spec}}`` with ``"shared": {part name: base64 of the
zlib-compressed JSON of the part}``, each part once per body. Broadcast: the packed spec is
``{"packed": "broadcast"}`` and the part is the plain spec. Sharded: ``{"packed": name,
"senders": [sender of each slot]}``, and the part a *template*: the plain spec with each
message's sender replaced by its slot (``senders[slot]`` gives it back), shared by all
workers of one server TP size and rank (only which replica sends differs between servers),
packed in columns (``"columns": 1``, :meth:`ReceiverSpecs._sharded_template`: indices into
its distinct names, shapes, padding rows and piece kinds, as differences). :func:`worker_specs` turns a body back
into plain specs; a plain spec in place of a packed one (the format before packing) is read as
it is. For a Qwen3-30B-A3B-sized MoE a TP-4 server's body is ~75 KB in broadcast mode (the
bucket list of 18,000 tensors, once) and ~25 KB in sharded mode, where the plain specs were
~5 MB (``benchmarks/connect_plan.py``).
"""

from __future__ import annotations

import base64
import json
import math
import zlib
from dataclasses import dataclass
from functools import cached_property

from megarl.bridge.transfer_plan import Owner, Piece, SourceParam, TransferPlan, gc_paused
from megarl.serving.init_specs import expand_template, from_columns


def _cut(items: list, sizes: list[int], limit: int) -> list[list]:
    """Consecutive runs of ``items`` whose sizes sum to at most ``limit`` (an oversized item alone)."""
    buckets, current, used = [], [], 0
    for item, size in zip(items, sizes):
        if current and used + size > limit:
            buckets.append(current)
            current, used = [], 0
        current.append(item)
        used += size
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class BroadcastSchedule:
    """Senders in order, each with its buckets of source parameters."""

    senders: list[Owner]
    buckets: list[list[list[SourceParam]]]

    def entries(self, plan: TransferPlan, sender: int, bucket: int) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of each tensor of one bucket, in buffer order."""
        return [(n, plan.hf_shapes[n]) for src in self.buckets[sender][bucket] for n in src.hf_names]


def broadcast_schedule(plan: TransferPlan, bucket_numel: int) -> BroadcastSchedule:
    """Per broadcast sender, its exported parameters cut into buckets of <= ``bucket_numel`` elements."""
    senders, buckets = [], []
    for owner, params in plan.broadcast_senders().items():
        sizes = [sum(math.prod(plan.hf_shapes[n]) for n in src.hf_names) for src in params]
        senders.append(owner)
        buckets.append(_cut(params, sizes, bucket_numel))
    return BroadcastSchedule(senders, buckets)


def _owner_order(owner: Owner) -> tuple:
    return (owner.pp, owner.expert, owner.ep, owner.tp, owner.replica)


@dataclass(frozen=True)
class ShardedSchedule:
    """Sender owners (their rank in the sharded group = index) and each pair's buckets of pieces."""

    senders: list[Owner]
    pairs: dict[tuple[int, int], list[list[Piece]]]
    """(sender index, worker index) -> buckets of pieces (pairs of workers that share a plan list
    share these lists too)."""

    @cached_property
    @gc_paused()
    def ordered(self) -> list[tuple[int, int, list[list[Piece]]]]:
        """(sender, worker, buckets) of every pair, sorted once."""
        return [(s, w, buckets) for (s, w), buckets in sorted(self.pairs.items())]

    @cached_property
    def rounds(self) -> int:
        return max((len(b) for b in self.pairs.values()), default=0)

    def round_messages(self, k: int) -> list[tuple[int, int, list[Piece]]]:
        """(sender, worker, pieces) of every message of round ``k``, in a fixed order."""
        return [(s, w, buckets[k]) for s, w, buckets in self.ordered if k < len(buckets)]

    @cached_property
    @gc_paused()
    def by_worker(self) -> dict[int, list[tuple[int, list[list[Piece]]]]]:
        """Per worker: its (sender, buckets) pairs in sender order, indexed in one pass."""
        out: dict[int, list[tuple[int, list[list[Piece]]]]] = {}
        for s, w, buckets in self.ordered:
            out.setdefault(w, []).append((s, buckets))
        return out


@gc_paused()
def sharded_schedule(plan: TransferPlan, bucket_numel: int) -> ShardedSchedule:
    """Per (sender, worker) pair, its pieces cut into buckets of <= ``bucket_numel`` elements.

    Each distinct piece list of the plan (one per server TP size and rank) is grouped by owner
    and cut once; a worker's pairs take those buckets with the replica that sends to it
    (:meth:`~megarl.bridge.transfer_plan.TransferPlan.sender`). O(pieces of the distinct lists +
    workers x their senders), then one sort of the pairs.
    """
    cut: dict[int, dict[Owner, list[list[Piece]]]] = {}
    for pieces in plan.pieces.values():
        if id(pieces) not in cut:
            by_owner: dict[Owner, list[Piece]] = {}
            for piece in pieces:
                by_owner.setdefault(piece.owner, []).append(piece)
            cut[id(pieces)] = {o: _cut(ps, [p.numel for p in ps], bucket_numel) for o, ps in by_owner.items()}
    sending = [
        (plan.sender(worker, owner), worker, buckets)
        for worker, pieces in plan.pieces.items()
        for owner, buckets in cut[id(pieces)].items()
    ]
    owners = sorted({o for o, _, _ in sending}, key=_owner_order)
    index = {o: i for i, o in enumerate(owners)}
    return ShardedSchedule(owners, {(index[o], w): buckets for o, w, buckets in sending})


# ---------------------------------------------------------------------------------------
# what a receiver is told (JSON-friendly)
# ---------------------------------------------------------------------------------------


def sender_group_ranks(owners: list, rank_of) -> tuple[list[int], int]:
    """Group rank of each sharded-mode sender (``rank_of(owner)``: its trainer rank) and the number of sending ranks.

    A trainer rank that is several owners (a dense and an expert shard) is one group member.
    """
    ranks = sorted({rank_of(o) for o in owners})
    index = {r: i for i, r in enumerate(ranks)}
    return [index[rank_of(o)] for o in owners], len(ranks)


def receiver_spec(
    plan: TransferPlan,
    worker: int,
    mode: str,
    bucket_numel: int,
    sender_ranks: list[int] | None = None,
    schedule: BroadcastSchedule | ShardedSchedule | None = None,
) -> dict:
    """What worker ``worker`` must know to receive in ``mode``: its local tensors and its messages.

    ``sender_ranks`` (sharded mode): group rank of each schedule sender (:func:`sender_group_ranks`).
    ``schedule``: the mode's schedule if already built (else it is built here; for many workers
    build it once and use :class:`ReceiverSpecs`).
    """
    if mode not in ("broadcast", "sharded"):
        raise ValueError(f"receiver_spec: mode {mode!r} has no group schedule (broadcast or sharded)")
    if schedule is None:
        schedule = (broadcast_schedule if mode == "broadcast" else sharded_schedule)(plan, bucket_numel)
    return ReceiverSpecs(plan, sender_ranks=sender_ranks, **{mode: schedule}).spec(worker, mode)


PACK_LEVEL = 6
"""zlib level of packed specs."""


class ReceiverSpecs:
    """Every worker's receive specs for one connect, each distinct part computed and packed once.

    The broadcast spec is the same for every worker. A sharded spec splits into a *template*
    (tensors, and rounds whose messages name their sender by slot), shared by the workers whose
    plan lists and buckets are shared (one per server TP size and rank, whatever the number of
    servers), and the worker's own sender of each slot; templates are built in their packed form
    (columns, :func:`~megarl.serving.init_specs.from_columns` reads them). :meth:`server` gives one server's part of the init
    body (the wire format is in the module docstring); :meth:`spec` the plain spec of one worker,
    what the receiver decodes (:func:`worker_specs`). Returned objects are shared: do not modify them.
    """

    def __init__(
        self,
        plan: TransferPlan,
        broadcast: BroadcastSchedule | None = None,
        sharded: ShardedSchedule | None = None,
        sender_ranks: list[int] | None = None,
    ):
        if sharded is not None and (sender_ranks is None or len(sender_ranks) != len(sharded.senders)):
            raise ValueError(f"receiver_spec: need the group rank of each of the {len(sharded.senders)} senders")
        self.plan, self.broadcast, self.sharded = plan, broadcast, sharded
        self.sender_ranks = list(sender_ranks) if sender_ranks is not None else None
        self.first_worker = [0]
        for tp in plan.server_tp:
            self.first_worker.append(self.first_worker[-1] + tp)
        self._parts: dict = {}
        """Part name -> the part (the broadcast spec, or a sharded template in columns)."""
        self._names: dict[tuple, str] = {}
        """Key of a sharded template (the worker's plan list and bucket lists) -> its part name."""
        self._packed: dict[str, str] = {}
        self._bodies: dict[tuple[str, ...], list[tuple[dict, dict]]] = {}

    def spec(self, worker: int, mode: str) -> dict:
        """The plain spec of ``worker`` in ``mode`` (what :func:`receiver_spec` returns)."""
        name, senders = self._part(worker, mode)
        part = self._parts[name]
        return part if mode == "broadcast" else expand_template(from_columns(part), senders)

    def server(self, server: int, modes) -> tuple[dict, dict]:
        """``(specs, shared)`` of one server's init body: ``{str(TP rank): {mode: packed spec}}`` and the
        packed parts those name (one copy per server, however many of its workers name one). The
        first call computes every server's (a connect asks for all), with one pause of the garbage
        collector instead of one per server."""
        modes = tuple(modes)
        if modes not in self._bodies:
            self._bodies[modes] = self._all_servers(modes)
        return self._bodies[modes][server]

    @gc_paused()
    def _all_servers(self, modes: tuple[str, ...]) -> list[tuple[dict, dict]]:
        out = []
        for server, tp in enumerate(self.plan.server_tp):
            specs, shared = {}, {}
            for rank in range(tp):
                mine = {}
                for mode in modes:
                    name, senders = self._part(self.first_worker[server] + rank, mode)
                    mine[mode] = {"packed": name} if senders is None else {"packed": name, "senders": senders}
                    if name not in self._packed:
                        self._packed[name] = _pack(self._parts[name])
                    shared[name] = self._packed[name]
                specs[str(rank)] = mine
            out.append((specs, shared))
        return out

    def _part(self, worker: int, mode: str) -> tuple[str, list[int] | None]:
        """(part name, sender of each slot: sharded) of ``worker``'s spec in ``mode``, the part built once."""
        if mode == "broadcast":
            if self.broadcast is None:
                raise ValueError("ReceiverSpecs: no broadcast schedule given")
            if "broadcast" not in self._parts:
                self._parts["broadcast"] = self._broadcast_spec()
            return "broadcast", None
        if mode != "sharded":
            raise ValueError(f"receiver_spec: mode {mode!r} has no group schedule (broadcast or sharded)")
        if self.sharded is None:
            raise ValueError("ReceiverSpecs: no sharded schedule given")
        pairs = self.sharded.by_worker.get(worker, [])
        key = (id(self.plan.local[worker]), *(id(buckets) for _, buckets in pairs))
        if key not in self._names:
            self._names[key] = name = f"sharded-{len(self._names)}"
            self._parts[name] = self._sharded_template(worker, pairs)
        return self._names[key], [s for s, _ in pairs]

    @gc_paused()
    def _broadcast_spec(self) -> dict:
        sched, plan = self.broadcast, self.plan
        buckets = [
            [[[n, list(shape)] for n, shape in sched.entries(plan, s, b)] for b in range(len(bs))]
            for s, bs in enumerate(sched.buckets)
        ]
        return {"mode": "broadcast", "senders": len(sched.senders), "buckets": buckets}

    @gc_paused()
    def _sharded_template(self, worker: int, pairs: list) -> dict:
        """``worker``'s sharded template in columns, straight from the plan: tensors as differences of
        indices into their distinct names / shapes / padding rows (``expert`` -1: none), each
        message's pieces as differences of tensor slots and indices into the distinct
        ``(dim, dest start, length)``; messages name their sender by slot."""
        local = self.plan.local[worker]
        names: dict = {}  # distinct value -> its index, in order of first use
        shapes: dict = {}
        paddings: dict = {}
        kinds: dict = {}
        slot = {(t.name, t.expert): i for i, t in enumerate(local)}
        tensors = {
            "name": _delta([names.setdefault(t.name, len(names)) for t in local]),
            "expert": _delta([-1 if t.expert is None else t.expert for t in local]),
            "shape": [shapes.setdefault(t.shape, len(shapes)) for t in local],
            "padding": [paddings.setdefault(_padding_rows(t), len(paddings)) for t in local],
        }
        rounds = [
            [
                [
                    j,
                    _delta([slot[p.dest, p.expert] for p in buckets[k]]),
                    [kinds.setdefault((p.dim, p.dest_start, p.length), len(kinds)) for p in buckets[k]],
                ]
                for j, (_, buckets) in enumerate(pairs)
                if k < len(buckets)
            ]
            for k in range(self.sharded.rounds)
        ]
        return {
            "mode": "sharded",
            "columns": 1,
            "senders": len(self.sharded.senders),
            "sender_ranks": self.sender_ranks,
            "names": list(names),
            "shapes": [list(x) for x in shapes],
            "paddings": [[list(r) for r in x] for x in paddings],
            "kinds": [list(x) for x in kinds],
            "tensors": tensors,
            "rounds": rounds,
        }


@gc_paused()
def _pack(part: dict) -> str:
    """A spec part as the init body carries it: base64 of the zlib-compressed compact JSON."""
    text = json.dumps(part, separators=(",", ":")).encode()
    return base64.b64encode(zlib.compress(text, PACK_LEVEL)).decode("ascii")


def _delta(values: list[int]) -> list[int]:
    return [b - a for a, b in zip([0, *values[:-1]], values)]


def _padding_rows(tensor) -> tuple[tuple[int, int], ...]:
    """[start, stop) rows along the split dim that are padding (the receiver zero-fills them)."""
    out, offset = [], 0
    for seg in tensor.segments:
        if seg.hf is None:
            out.append((offset, offset + seg.length))
        offset += seg.length
    return tuple(out)
