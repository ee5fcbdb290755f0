"""Buckets, receiver specs, group wiring and the consistency metric (pure, no processes)."""

from __future__ import annotations

import math

import pytest

from megarl.bridge.consistency import compare, probe_batch
from megarl.bridge.schedule import (
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
        assert flat == [p for p in plan.pieces[w] if p.owner == ssched.senders[s]]  # plan order kept
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
