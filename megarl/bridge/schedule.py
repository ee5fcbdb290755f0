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
packed in columns (``"columns": 1``, :func:`_columns`: indices into its distinct names,
shapes, padding rows and piece kinds, as differences). :func:`worker_specs` turns a body back
into plain specs; a plain spec in place of a packed one (the format before packing) is read as
it is. For a Qwen3-30B-A3B-sized MoE a TP-4 server's body is ~75 KB in broadcast mode (the
bucket list of 18,000 tensors, once) and ~25 KB in sharded mode, where the plain specs were
~5 MB (``benchmarks/connect_plan.py``).
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
import math
import zlib
from dataclasses import dataclass
from functools import cached_property

from megarl.bridge.transfer_plan import Owner, Piece, SourceParam, TransferPlan, gc_paused


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
    servers), and the worker's own sender of each slot. :meth:`server` gives one server's part of
    the init body (the wire format is in the module docstring); :meth:`spec` the plain spec of one
    worker, what the receiver decodes (:func:`worker_specs`). The returned objects are shared: do not
    modify them.
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
        self._broadcast: dict | None = None
        self._names: dict[tuple, str] = {}
        """Key of a sharded template (the worker's plan list and bucket lists) -> its name."""
        self._templates: dict[str, dict] = {}
        self._packed: dict[str, str] = {}

    def spec(self, worker: int, mode: str) -> dict:
        """The plain spec of ``worker`` in ``mode`` (what :func:`receiver_spec` returns)."""
        if mode == "broadcast":
            return self._broadcast_spec()
        if mode != "sharded":
            raise ValueError(f"receiver_spec: mode {mode!r} has no group schedule (broadcast or sharded)")
        _, template, senders = self._sharded_template(worker)
        return _expand(template, senders)

    @gc_paused()
    def server(self, server: int, modes) -> tuple[dict, dict]:
        """``(specs, shared)`` of one server's init body: ``{str(TP rank): {mode: packed spec}}`` and the
        packed parts those name (one copy per server, however many of its workers name one)."""
        specs, shared = {}, {}
        for rank in range(self.plan.server_tp[server]):
            worker = self.first_worker[server] + rank
            mine = {}
            for mode in modes:
                if mode == "broadcast":
                    name, part = "broadcast", self._broadcast_spec()
                    mine[mode] = {"packed": name}
                elif mode == "sharded":
                    name, part, senders = self._sharded_template(worker)
                    mine[mode] = {"packed": name, "senders": senders}
                else:
                    raise ValueError(f"receiver_spec: mode {mode!r} has no group schedule (broadcast or sharded)")
                if name not in self._packed:
                    self._packed[name] = pack_part(part)
                shared[name] = self._packed[name]
            specs[str(rank)] = mine
        return specs, shared

    def _broadcast_spec(self) -> dict:
        if self._broadcast is None:
            if self.broadcast is None:
                raise ValueError("ReceiverSpecs: no broadcast schedule given")
            sched, plan = self.broadcast, self.plan
            buckets = [
                [[[n, list(shape)] for n, shape in sched.entries(plan, s, b)] for b in range(len(bs))]
                for s, bs in enumerate(sched.buckets)
            ]
            self._broadcast = {"mode": "broadcast", "senders": len(sched.senders), "buckets": buckets}
        return self._broadcast

    def _sharded_template(self, worker: int) -> tuple[str, dict, list[int]]:
        """(name, template, sender of each slot) of ``worker``'s sharded spec."""
        if self.sharded is None:
            raise ValueError("ReceiverSpecs: no sharded schedule given")
        pairs = self.sharded.by_worker.get(worker, [])
        key = (id(self.plan.local[worker]), *(id(buckets) for _, buckets in pairs))
        if key not in self._names:
            local = self.plan.local[worker]
            slot = {(t.name, t.expert): i for i, t in enumerate(local)}
            rounds = [
                [
                    [j, [[slot[p.dest, p.expert], p.dim, p.dest_start, p.length] for p in buckets[k]]]
                    for j, (_, buckets) in enumerate(pairs)
                    if k < len(buckets)
                ]
                for k in range(self.sharded.rounds)
            ]
            template = {
                "mode": "sharded",
                "senders": len(self.sharded.senders),
                "sender_ranks": self.sender_ranks,
                "tensors": [[t.name, t.expert, list(t.shape), _padding_rows(t)] for t in local],
                "rounds": rounds,
            }
            self._names[key] = f"sharded-{len(self._names)}"
            self._templates[self._names[key]] = template
        name = self._names[key]
        return name, self._templates[name], [s for s, _ in pairs]


def _expand(template: dict, senders: list[int]) -> dict:
    """A sharded template with each message's slot replaced by its sender: the plain spec."""
    rounds = [[[senders[j], pieces] for j, pieces in msgs] for msgs in template["rounds"]]
    return {**template, "sender_ranks": list(template["sender_ranks"]), "rounds": rounds}


def pack_part(part: dict) -> str:
    """A spec part as the init body carries it: base64 of the zlib-compressed compact JSON of the
    part (a sharded template in columns: :func:`_columns`)."""
    if part["mode"] == "sharded":
        part = _columns(part)
    text = json.dumps(part, separators=(",", ":")).encode()
    return base64.b64encode(zlib.compress(text, PACK_LEVEL)).decode("ascii")


@functools.lru_cache(maxsize=16)
def unpack_part(packed: str) -> dict:
    """The part of :func:`pack_part`, decoded once per distinct part (the trainer's SGLang controls
    hold one body per server, all naming the same part: one copy). Do not modify it."""
    part = json.loads(zlib.decompress(base64.b64decode(packed)))
    return _from_columns(part) if "columns" in part else part


class _Index:
    """Distinct values in order of first use; calling it gives a value's index."""

    def __init__(self):
        self.values: list = []
        self._at: dict = {}

    def __call__(self, value) -> int:
        at = self._at.get(value)
        if at is None:
            at = self._at[value] = len(self.values)
            self.values.append(value)
        return at


def _delta(values: list[int]) -> list[int]:
    return [b - a for a, b in zip([0, *values[:-1]], values)]


def _undelta(deltas: list[int]) -> list[int]:
    return list(itertools.accumulate(deltas))


def _columns(template: dict) -> dict:
    """A sharded template in columns, what compresses well: tensors as differences of indices into
    their distinct names / shapes / padding rows (``expert`` -1: none), each message's pieces as
    differences of tensor slots and indices into the distinct ``(dim, start, length)``."""
    names, shapes, paddings, kinds = _Index(), _Index(), _Index(), _Index()
    tensors = template["tensors"]
    return {
        "mode": "sharded",
        "columns": 1,
        "senders": template["senders"],
        "sender_ranks": template["sender_ranks"],
        "names": names.values,
        "shapes": shapes.values,
        "paddings": paddings.values,
        "kinds": kinds.values,
        "tensors": {
            "name": _delta([names(t[0]) for t in tensors]),
            "expert": _delta([-1 if t[1] is None else t[1] for t in tensors]),
            "shape": [shapes(tuple(t[2])) for t in tensors],
            "padding": [paddings(tuple(tuple(r) for r in t[3])) for t in tensors],
        },
        "rounds": [
            [[j, _delta([p[0] for p in pieces]), [kinds(tuple(p[1:])) for p in pieces]] for j, pieces in messages]
            for messages in template["rounds"]
        ],
    }


def _from_columns(part: dict) -> dict:
    """The sharded template of :func:`_columns`."""
    names, shapes, paddings, kinds = part["names"], part["shapes"], part["paddings"], part["kinds"]
    columns = part["tensors"]
    tensors = [
        [names[n], None if e < 0 else e, list(shapes[s]), [list(r) for r in paddings[p]]]
        for n, e, s, p in zip(
            _undelta(columns["name"]), _undelta(columns["expert"]), columns["shape"], columns["padding"]
        )
    ]
    rounds = [
        [[j, [[slot, *kinds[k]] for slot, k in zip(_undelta(slots), ks)]] for j, slots, ks in messages]
        for messages in part["rounds"]
    ]
    return {
        "mode": "sharded",
        "senders": part["senders"],
        "sender_ranks": part["sender_ranks"],
        "tensors": tensors,
        "rounds": rounds,
    }


def worker_specs(specs: dict, shared: dict | None, rank: int) -> dict:
    """``{mode: plain spec}`` of TP rank ``rank`` from an init body's ``specs`` and ``shared``
    (plain specs, the format before packing, are taken as they are)."""
    out = {}
    for mode, spec in specs[str(rank)].items():
        if "packed" not in spec:
            out[mode] = spec
            continue
        part = unpack_part((shared or {})[spec["packed"]])
        out[mode] = _expand(part, spec["senders"]) if part["mode"] == "sharded" else part
    return out


def _padding_rows(tensor) -> list[list[int]]:
    """[start, stop) rows along the split dim that are padding (the receiver zero-fills them)."""
    out, offset = [], 0
    for seg in tensor.segments:
        if seg.hf is None:
            out.append([offset, offset + seg.length])
        offset += seg.length
    return out
