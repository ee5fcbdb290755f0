"""Buckets, receiver specs, group wiring and the consistency metric (pure, no processes)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

import megarl.bridge.bridge as bridge_module
import megarl.bridge.schedule as schedule_module
import megarl.bridge.transfer_plan as plan_module
from megarl.bridge.consistency import compare, probe_batch
from megarl.bridge.schedule import (
    ReceiverSpecs,
    _cut,
    broadcast_schedule,
    receiver_spec,
    sender_group_ranks,
    sharded_schedule,
)
from megarl.bridge.transfer_plan import Owner, build_plan
from megarl.bridge.wiring import Wiring, make_wiring
from megarl.config.allocation import TrainingAllocation
from megarl.config.base import ConfigError
from megarl.config.bridge import WeightUpdateConfig
from megarl.models.build import describe
from megarl.models.hf_io import SafetensorsReader
from megarl.serving.init_specs import worker_specs


@pytest.fixture(scope="module")
def plan(tiny_model_dir):
    path = tiny_model_dir("qwen3_moe")
    reader = SafetensorsReader(path)
    layout = TrainingAllocation(tp=2, pp=2, ep=2, etp=1)
    return build_plan(describe(path, 2), {n: reader.shape(n) for n in reader.keys()}, layout, (1, 2))  # noqa: SIM118 (the reader is not iterable)


@pytest.mark.parametrize("bucket", [1, 50_000, 10**9])
def test_buckets_respect_the_limit_and_keep_every_item_once(plan, bucket):
    bsched = broadcast_schedule(plan, bucket)
    for buckets in bsched.buckets:
        for b in buckets:
            size = sum(math.prod(plan.hf_shapes[n]) for src in b for n in src.hf_names)
            assert size <= bucket or len(b) == 1  # only a single oversized parameter exceeds it
    sent = [src.megatron for buckets in bsched.buckets for b in buckets for src in b]
    assert sorted(sent) == sorted(s.megatron for s in plan.sources if s.rule.export)
    ssched = sharded_schedule(plan, bucket)
    for (s, w), buckets in ssched.pairs.items():
        flat = [p for b in buckets for p in b]
        assert flat == [p for p in plan.pieces[w] if plan.sender(w, p.owner) == ssched.senders[s]]  # plan order kept
        assert all(sum(p.numel for p in b) <= bucket or len(b) == 1 for b in buckets)


def test_receiver_specs_describe_each_workers_messages(plan):
    bsched = broadcast_schedule(plan, 50_000)
    spec = receiver_spec(plan, 0, "broadcast", 50_000)
    assert spec["senders"] == len(bsched.senders) == 6  # two stages x (dense + two EP expert shards)
    ssched = sharded_schedule(plan, 50_000)
    ranks, _ = sender_group_ranks(ssched.senders, lambda o: (o.pp, o.tp if not o.expert else o.ep))
    spec = receiver_spec(plan, 2, "sharded", 50_000, ranks)
    numel = sum(
        math.prod(spec["tensors"][slot][2]) // spec["tensors"][slot][2][dim] * length
        if dim is not None
        else math.prod(spec["tensors"][slot][2])
        for msgs in spec["rounds"]
        for _, pieces in msgs
        for slot, dim, _, length in pieces
    )
    assert numel == plan.worker_numel(2)
    with pytest.raises(ValueError, match="group rank"):
        receiver_spec(plan, 2, "sharded", 50_000)


def test_a_rank_that_is_two_owners_is_one_group_member():
    dense, expert = Owner(0, 0), Owner(0, 0, 0, True)
    ranks, num = sender_group_ranks([dense, expert, Owner(1, 0)], {dense: 0, expert: 0, Owner(1, 0): 5}.__getitem__)
    assert (ranks, num) == ([0, 0, 1], 2)


def test_wiring_round_trips_and_hosts_each_group_once():
    owners = [Owner(0, 0), Owner(1, 0)]
    rank_of = {owners[0]: 0, owners[1]: 2}.__getitem__
    wiring = make_wiring("gloo", 3, owners, owners, rank_of, lambda r, k: (f"h{r}", 100 * r + k), "p")
    assert [g.world_size for g in wiring.broadcast] == [4, 4] and wiring.sharded.world_size == 5
    assert (wiring.broadcast[0].host, wiring.broadcast[0].port) == ("h0", 0)
    assert (wiring.sharded.host, wiring.sharded.port) == ("h0", 1)  # rank 0's second group
    assert wiring.groups_hosted_by(0) == 2 and wiring.groups_hosted_by(2) == 1
    assert Wiring.from_json(wiring.to_json()) == wiring


def test_consistency_metric():
    scores = {"a": [[-1.0, -2.5], [-3.1]], "b": [[-1.0, -2.0], [-3.0]]}
    report = compare([[-1.0, -2.0], [-3.0]], scores, 0.15)
    assert report.per_server["a"] == pytest.approx((0.5, 0.2))
    assert report.max_abs == pytest.approx(0.5) and report.worst_mean == pytest.approx(0.2) and not report.ok
    assert compare([[-1.0, -2.0], [-3.0]], scores, 0.3).ok, "the threshold applies to the mean, not single tokens"
    assert report.as_dict()["server1/logprob_diff_max"] == 0.0
    with pytest.raises(ValueError, match="scored 1 probe tokens"):
        compare([[-1.0, -2.0]], {"a": [[-1.0]]}, 0.3)
    batch = probe_batch([[1, 2, 3], [4]])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]] and batch["attention_mask"].sum() == 4


def test_config_checks_name_the_bad_value():
    WeightUpdateConfig().check()
    assert WeightUpdateConfig(mode="broadcast", extra_modes=["sharded", "broadcast"]).modes == ("broadcast", "sharded")
    assert WeightUpdateConfig().bucket_bytes(on_gpu=True) == 2**30
    for bad, key in [
        ({"mode": "nccl"}, "mode"),
        ({"mode": "disk"}, "disk_path"),
        ({"bucket_mb": 0}, "bucket_mb"),
        ({"extra_modes": ["x"]}, "extra_modes"),
        ({"update_timeout": 0}, "update_timeout"),
    ]:
        with pytest.raises(ConfigError, match=key):
            WeightUpdateConfig(**bad).check()


# ---------------------------------------------------------------------------------------
# connect-time planning: every worker's spec from schedules built once, small init bodies
# ---------------------------------------------------------------------------------------


def _old_pieces(plan, worker: int) -> list:
    """``worker``'s pieces as the plan listed them per worker before planning was shared: each
    names the replica that sends it (``server % replicas``)."""
    server = plan.workers[worker][0]
    out = []
    for p in plan.pieces[worker]:
        replicas = plan.trainer.edp if p.owner.expert else plan.trainer.dense_replicas
        out.append(dataclasses.replace(p, owner=dataclasses.replace(p.owner, replica=server % replicas)))
    return out


def _old_sharded_schedule(plan, bucket_numel: int) -> tuple[list, dict]:
    """The sharded schedule as it was computed before (the reference): senders and pairs."""
    pieces = {w: _old_pieces(plan, w) for w in plan.pieces}
    owners = sorted(
        {p.owner for ps in pieces.values() for p in ps}, key=lambda o: (o.pp, o.expert, o.ep, o.tp, o.replica)
    )
    index = {o: i for i, o in enumerate(owners)}
    per_pair: dict = {}
    for worker, ps in sorted(pieces.items()):
        for piece in ps:
            per_pair.setdefault((index[piece.owner], worker), []).append(piece)
    return owners, {key: _cut(ps, [p.numel for p in ps], bucket_numel) for key, ps in per_pair.items()}


def _old_padding_rows(tensor) -> list[list[int]]:
    out, offset = [], 0
    for seg in tensor.segments:
        if seg.hf is None:
            out.append([offset, offset + seg.length])
        offset += seg.length
    return out


def _old_receiver_spec(plan, worker: int, mode: str, bucket_numel: int, sender_ranks=None) -> dict:
    """``receiver_spec`` as it was: the whole schedule recomputed, every pair re-sorted each round."""
    if mode == "broadcast":
        sched = broadcast_schedule(plan, bucket_numel)
        buckets = [
            [[[n, list(shape)] for n, shape in sched.entries(plan, s, b)] for b in range(len(bs))]
            for s, bs in enumerate(sched.buckets)
        ]
        return {"mode": mode, "senders": len(sched.senders), "buckets": buckets}
    owners, pairs = _old_sharded_schedule(plan, bucket_numel)
    local = plan.local[worker]
    slot = {(t.name, t.expert): i for i, t in enumerate(local)}
    rounds = []
    for k in range(max(len(b) for b in pairs.values())):
        messages = [(s, w, buckets[k]) for (s, w), buckets in sorted(pairs.items()) if k < len(buckets)]
        rounds.append(
            [
                [s, [[slot[p.dest, p.expert], p.dim, p.dest_start, p.length] for p in pieces]]
                for s, w, pieces in messages
                if w == worker
            ]
        )
    tensors = [[t.name, t.expert, list(t.shape), _old_padding_rows(t)] for t in local]
    return {
        "mode": mode,
        "senders": len(owners),
        "sender_ranks": list(sender_ranks),
        "tensors": tensors,
        "rounds": rounds,
    }


def _shapes(path):
    reader = SafetensorsReader(path)
    return {n: reader.shape(n) for n in reader.keys()}  # noqa: SIM118 (the reader is not iterable)


PLANS = {
    "llama-tp2-pp2-dp2": ("llama", TrainingAllocation(tp=2, pp=2, dp=2), (2, 2, 1, 4, 2)),
    "qwen2-pp4-dp2": ("qwen2", TrainingAllocation(pp=4, dp=2), (1, 2, 2)),
    "qwen3-moe-tp2-pp2-ep2-dp2": ("qwen3_moe", TrainingAllocation(tp=2, pp=2, ep=2, etp=1, dp=2), (2, 2, 2, 1)),
    "qwen3-moe-ep1-etp2-dp3": ("qwen3_moe", TrainingAllocation(tp=2, ep=1, etp=2, dp=3), (2, 4, 2, 2)),
}


@pytest.mark.parametrize("bucket", [3_000, 10**9])
@pytest.mark.parametrize("name", list(PLANS))
def test_specs_from_one_schedule_equal_the_old_per_worker_specs(tiny_model_dir, name, bucket):
    family, layout, servers = PLANS[name]
    path = tiny_model_dir(family)
    plan = build_plan(describe(path, layout.tp), _shapes(path), layout, servers)
    bsched, ssched = broadcast_schedule(plan, bucket), sharded_schedule(plan, bucket)
    owners, pairs = _old_sharded_schedule(plan, bucket)
    assert ssched.senders == owners and sorted(ssched.pairs) == sorted(pairs)
    for (s, w), buckets in ssched.pairs.items():  # the same pieces, sent by the same replica
        assert [[dataclasses.replace(p, owner=owners[s]) for p in b] for b in buckets] == pairs[s, w]
    for k in range(ssched.rounds):
        assert [(s, w) for s, w, _ in ssched.round_messages(k)] == [
            (s, w) for (s, w), b in sorted(pairs.items()) if k < len(b)
        ]
    ranks = list(range(len(ssched.senders)))[::-1]  # any group ranks: they are handed through
    specs = ReceiverSpecs(plan, bsched, ssched, ranks)
    for worker in range(len(plan.workers)):
        for mode in ("broadcast", "sharded"):
            old = _old_receiver_spec(plan, worker, mode, bucket, ranks)
            assert specs.spec(worker, mode) == old, (worker, mode)
            assert receiver_spec(plan, worker, mode, bucket, ranks) == old
    for server in range(len(servers)):  # what a server's workers decode from its init body (through JSON)
        packed, shared = specs.server(server, ["broadcast", "sharded"])
        body = json.loads(json.dumps({"specs": packed, "shared": shared}))
        for rank in range(servers[server]):
            worker = plan.worker_index(server, rank)
            decoded = worker_specs(body["specs"], body["shared"], rank)
            assert decoded == {m: _old_receiver_spec(plan, worker, m, bucket, ranks) for m in decoded}
    # one template per (server TP size, rank), whatever the number of servers and replicas
    assert len(specs._names) == len({(tp, r) for tp in servers for r in range(tp)})


def test_plain_specs_in_an_init_body_still_read(plan):
    spec = receiver_spec(plan, 0, "broadcast", 50_000)
    assert worker_specs({"0": {"broadcast": spec}}, None, 0) == {"broadcast": spec}


class _FakeServer:
    """What ``WeightBridge.connect`` calls on a server; keeps the init body it is given."""

    name = "vllm"

    def __init__(self, port: int, tp: int):
        self.address, self.tp, self.body = f"127.0.0.1:{port}", tp, None

    def init_group(self, info: dict) -> None:
        self.body = json.loads(json.dumps(info))  # what the server gets: the body through JSON


def test_a_connect_builds_each_schedule_once_and_one_template_per_tp_rank(tiny_model_dir, monkeypatch):
    """Planning scales: a connect to 12 servers builds each schedule once (before: once more per
    worker) and one sharded spec per (server TP size, rank), not one per worker."""
    from megarl.bridge.bridge import WeightBridge
    from megarl.bridge.source import TrainerCoords

    calls = {"broadcast_schedule": 0, "sharded_schedule": 0}
    for fn in (broadcast_schedule, sharded_schedule):

        def counted(*args, fn=fn, **kwargs):
            calls[fn.__name__] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(schedule_module, fn.__name__, counted)
        monkeypatch.setattr(bridge_module, fn.__name__, counted)
    monkeypatch.setattr(
        bridge_module, "trainer_join", lambda wiring, rank, timeout, stores=None: ({}, None)
    )  # no groups formed
    path = tiny_model_dir("llama")
    config = WeightUpdateConfig(mode="sharded", extra_modes=["broadcast"])
    bridge = WeightBridge(config, describe(path, 1), _shapes(path), TrainingAllocation(), TrainerCoords(0))
    servers = [_FakeServer(9000 + i, 2) for i in range(12)]
    bridge.connect(servers)
    assert calls == {"broadcast_schedule": 1, "sharded_schedule": 1}
    bodies = [s.body for s in servers]
    assert all(len(b["shared"]) == 3 for b in bodies)  # the broadcast spec, one sharded template per TP rank
    assert len({b["shared"]["broadcast"] for b in bodies}) == 1  # packed once, the same part for all
    for server, body in enumerate(bodies):
        for rank in range(2):
            worker = bridge.plan.worker_index(server, rank)
            decoded = worker_specs(body["specs"], body["shared"], rank)
            bucket, ranks = bridge.bucket_numel, body["wiring"]["sender_ranks"]
            assert decoded == {m: _old_receiver_spec(bridge.plan, worker, m, bucket, ranks) for m in decoded}


def test_planning_work_does_not_grow_with_the_servers(tiny_model_dir, monkeypatch):
    """The plan's matching runs once per (server TP size, rank): 2 servers or 24 cost the same."""
    path = tiny_model_dir("qwen3_moe")
    layout = TrainingAllocation(tp=2, pp=2, ep=2, etp=1, dp=2)
    desc, shapes = describe(path, 2), _shapes(path)
    counts = []
    for servers in (2, 24):
        calls = []
        original = plan_module._pieces_for
        monkeypatch.setattr(plan_module, "_pieces_for", lambda *a, **k: calls.append(1) or original(*a, **k))
        plan = build_plan(desc, shapes, layout, (2,) * servers)
        monkeypatch.setattr(plan_module, "_pieces_for", original)
        counts.append(len(calls))
        assert plan.pieces[0] is plan.pieces[2 * servers - 2]  # one list for every server's rank 0
    assert counts[0] == counts[1]


def test_the_init_body_of_a_30b_moe_server_stays_under_256_kb():
    """Qwen3-30B-A3B-shaped (48 layers, 128 experts; no weights: shapes from the config) under the
    256-GPU config's trainer layout, to TP-4 servers: each server's init body, as JSON, <= 256 KB
    (before: about 5 MB, the broadcast bucket list per rank and every rank's sharded spec in full)."""
    from benchmarks.connect_plan import QWEN3_30B_A3B, hf_config, hf_shapes
    from megarl.bridge.bridge import WeightBridge
    from megarl.bridge.source import TrainerCoords
    from megarl.bridge.wiring import make_wiring
    from megarl.config.allocation import AllocationMode
    from tests.bridge.workers import layout_coords

    trainer = AllocationMode.from_str("megatron:d16p2t4e8et1").train
    desc = describe(hf_config(QWEN3_30B_A3B), trainer.tp)
    shapes = hf_shapes(desc, trainer)
    for mode in ("sharded", "broadcast"):
        config = WeightUpdateConfig(mode=mode, dtype="bfloat16", bucket_mb=1024)
        bridge = WeightBridge(config, desc, shapes, trainer, TrainerCoords(0))
        bridge.servers = [_FakeServer(9000 + i, 4) for i in range(2)]
        bridge.plan = build_plan(desc, shapes, trainer, (4, 4), sharded=mode == "sharded")
        bsched = broadcast_schedule(bridge.plan, bridge.bucket_numel)
        ssched = sharded_schedule(bridge.plan, bridge.bucket_numel) if mode == "sharded" else None
        owners = ssched.senders if ssched else bsched.senders
        coords = layout_coords(trainer)
        rank_of = {o: next(c.rank for c in coords if c.holds(o)) for o in owners}.__getitem__
        wiring = make_wiring(
            "nccl",
            8,
            [] if ssched else owners,
            owners if ssched else [],
            rank_of,
            lambda r, k: ("10.0.0.1", 29500 + k),
            "megarl-bridge-1",
        )
        specs = ReceiverSpecs(bridge.plan, bsched, ssched, wiring.sender_ranks)
        for server in range(2):
            body = json.dumps(bridge._init_info(bridge.plan, server, wiring.to_json(), config.modes, specs))
            assert len(body) <= 256 * 1024, (mode, len(body))
        decoded = worker_specs(json.loads(body)["specs"], json.loads(body)["shared"], 3)[mode]
        assert decoded == specs.spec(bridge.plan.worker_index(1, 3), mode)
