"""Which bridge groups exist, who hosts them, and which rank each member takes.

* Broadcast: one group per broadcast sender: the sender at rank 0 (it hosts the store),
  inference worker ``w`` at rank ``1 + w``.
* Sharded: one group: the trainer ranks that send at ranks ``0..S-1`` (the first hosts),
  worker ``w`` at ``S + w``.

A wiring covers one block of servers (:mod:`megarl.bridge.blocks`; worker indices are the
block's): the bridge makes one per block.

Every member joins its groups in the order listed here (broadcast groups, then the
sharded one), so the blocking rendezvous never waits in a cycle. :class:`Wiring` is
JSON-friendly: the trainer hands it to the servers at initialisation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megarl.bridge.groups import join_group
from megarl.bridge.schedule import sender_group_ranks


@dataclass(frozen=True)
class GroupSpec:
    """One group: its name, rendezvous address and size."""

    name: str
    host: str
    port: int
    world_size: int


@dataclass
class Wiring:
    """The bridge groups of one trainer <-> inference pairing."""

    backend: str
    num_workers: int
    broadcast: list[GroupSpec] = field(default_factory=list)
    broadcast_hosts: list[int] = field(default_factory=list)
    """Trainer rank of each broadcast sender (rank 0 of its group)."""
    sharded: GroupSpec | None = None
    sharded_members: list[int] = field(default_factory=list)
    """Trainer rank of each sharded-group sender rank ``0..S-1``."""
    sender_ranks: list[int] = field(default_factory=list)
    """Sharded group rank of each schedule sender."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Wiring:
        data = dict(data)
        data["broadcast"] = [GroupSpec(**g) for g in data["broadcast"]]
        data["sharded"] = GroupSpec(**data["sharded"]) if data["sharded"] else None
        return cls(**data)

    def groups_hosted_by(self, rank: int) -> int:
        """How many rendezvous ports trainer rank ``rank`` must provide."""
        hosted = sum(1 for r in self.broadcast_hosts if r == rank)
        return hosted + int(bool(self.sharded_members) and self.sharded_members[0] == rank)


def make_wiring(
    backend: str, num_workers: int, broadcast_owners: list, sharded_owners: list, rank_of, address_of, prefix: str
) -> Wiring:
    """Groups for the broadcast senders and the sharded senders (empty lists: that mode is off).

    ``rank_of(owner)``: trainer rank of an owner; ``address_of(trainer rank, k)``: the
    ``(host, port)`` of the ``k``-th group that rank hosts.
    """
    wiring = Wiring(backend, num_workers)
    hosted: dict[int, int] = {}

    def address(rank: int) -> tuple[str, int]:
        k = hosted.get(rank, 0)
        hosted[rank] = k + 1
        return address_of(rank, k)

    for i, owner in enumerate(broadcast_owners):
        rank = rank_of(owner)
        host, port = address(rank)
        wiring.broadcast.append(GroupSpec(f"{prefix}-b{i}", host, port, 1 + num_workers))
        wiring.broadcast_hosts.append(rank)
    if sharded_owners:
        wiring.sender_ranks, num_senders = sender_group_ranks(sharded_owners, rank_of)
        wiring.sharded_members = sorted({rank_of(o) for o in sharded_owners})
        host, port = address(wiring.sharded_members[0])
        wiring.sharded = GroupSpec(f"{prefix}-s", host, port, num_senders + num_workers)
    return wiring


def _join(spec: GroupSpec, rank: int, backend: str, timeout: float, stores: dict | None = None):
    store = (stores or {}).get(spec.port) if rank == 0 else None
    return join_group(spec.host, spec.port, spec.world_size, rank, spec.name, backend, timeout, store)


def trainer_join(wiring: Wiring, rank: int, timeout: float, stores: dict | None = None) -> tuple[dict, object]:
    """Join the groups trainer rank ``rank`` belongs to: ({broadcast sender index: group}, sharded group or None).
    ``stores``: port -> the store this rank hosts there (:func:`~megarl.bridge.groups.host_store`)."""
    broadcast = {
        i: _join(spec, 0, wiring.backend, timeout, stores)
        for i, (spec, host) in enumerate(zip(wiring.broadcast, wiring.broadcast_hosts))
        if host == rank
    }
    sharded = None
    if wiring.sharded is not None and rank in wiring.sharded_members:
        sharded = _join(wiring.sharded, wiring.sharded_members.index(rank), wiring.backend, timeout, stores)
    return broadcast, sharded


def worker_join(wiring: Wiring, worker: int, timeout: float) -> tuple[list, object]:
    """Join every group as inference worker ``worker``: (broadcast groups in sender order, sharded group or None)."""
    if not 0 <= worker < wiring.num_workers:
        raise ValueError(f"worker index {worker} outside the {wiring.num_workers} inference workers of this wiring")
    broadcast = [_join(spec, 1 + worker, wiring.backend, timeout) for spec in wiring.broadcast]
    sharded = None
    if wiring.sharded is not None:
        sharded = _join(wiring.sharded, len(wiring.sharded_members) + worker, wiring.backend, timeout)
    return broadcast, sharded
