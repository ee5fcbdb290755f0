"""Transports over real gloo groups: fake receivers in their own processes get byte-exact tensors.

Trainer ranks hold shards cut from a tiny HF checkpoint by the family mapping; worker
processes rebuild what arrives. Expected values are independent of the bridge: the HF
tensors themselves (broadcast, disk) and the HF tensors cut by each worker's target
layout (sharded), in the wire dtype. Two updates with different weights go through the
same groups (created once), the second into the first one's receive buffers (a CPU worker
that stages keeps them: :class:`~megarl.bridge.transport.ReceiveBuffers`).
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.bridge.transfer_plan import build_plan
from megarl.bridge.transport import ReceiveBuffers
from megarl.config.allocation import TrainingAllocation
from megarl.models.build import describe
from megarl.models.hf_io import SafetensorsReader
from megarl.utils.network import find_free_ports
from tests.actor.dist_utils import run_ranks
from tests.bridge.workers import WIRE, expected_local

pytestmark = pytest.mark.multiproc

CASES = {
    # family, trainer layout, server TPs: PP with TP, and EP experts to a TP-2 server
    "llama-tp2pp2": ("llama", {"tp": 2, "pp": 2}, [1, 2]),
    "qwen3_moe-tp2ep2": ("qwen3_moe", {"tp": 2, "ep": 2, "etp": 1}, [2]),
}
SLOW = {"llama-tp2pp2"}
"""Cases that run with the slow tests only (a minute and a half each; `make test` keeps the plan's pieces of
every layout in tests/bridge/test_transfer_plan.py and PP-2 senders in tests/bridge/test_sglang.py)."""


def run_with_fresh_ports(world_size: int, attempts: int = 3, **kwargs) -> list:
    """The transfer on ``world_size`` ranks. Its groups' 16 ports are found free before the ranks bind
    them, seconds later: a test running beside it may take one in between (EADDRINUSE), and then the
    ranks run again on other ports."""
    for attempt in range(1, attempts + 1):
        try:
            return run_ranks(
                world_size, "tests.bridge.workers:transfer", timeout=400, ports=find_free_ports(16), **kwargs
            )
        except RuntimeError as exc:
            if attempt == attempts or "EADDRINUSE" not in str(exc):
                raise
    return []  # not reached: the last attempt returns or raises


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_fake_receivers_get_exact_bytes(case, tiny_model_dir, tmp_path):
    family, layout, server_tp = CASES[case]
    model_dir = tiny_model_dir(family, vocab_size=1001)
    reader = SafetensorsReader(model_dir)
    hf = {n: reader(n, None, 0, 0) for n in reader.keys()}  # noqa: SIM118 (the reader is not iterable)
    trainer = TrainingAllocation(**layout)
    plan = build_plan(
        describe(model_dir, trainer.tp),
        {n: reader.shape(n) for n in reader.keys()},
        trainer,  # noqa: SIM118 (the reader is not iterable)
        tuple(server_tp),
    )
    bucket = 300_000  # elements: several buckets per sender, some tensors alone in theirs
    results = run_with_fresh_ports(
        trainer.world_size + len(plan.workers),
        model_dir=str(model_dir),
        layout=layout,
        server_tp=server_tp,
        bucket_numel=bucket,
        disk_dir=str(tmp_path / "disk"),
    )
    for result in results[trainer.world_size :]:
        worker, got = result["worker"], result["got"]
        kept = got["buffers", 0]
        assert {mode for mode, *_ in kept} == {"broadcast", "sharded"}
        assert got["buffers", 1] == kept  # the second update arrived in the first one's buffers
        for update in range(2):
            scale = 1.0 + update
            for mode in ("broadcast", "disk"):
                assert sorted(got[mode, update]) == sorted(hf), (mode, update)
                for name, tensor in hf.items():
                    assert torch.equal(got[mode, update][name], (tensor * scale).to(WIRE)), (mode, update, name)
            want = expected_local(plan, worker, hf, scale)
            assert sorted(got["sharded", update]) == sorted(want)
            for key, tensor in want.items():
                assert torch.equal(got["sharded", update][key], tensor), (update, worker, key)
            server = plan.workers[worker][0]
            assert got["sharded_bytes", update] == plan.worker_numel(worker) * WIRE.itemsize
            model_bytes = sum(math.prod(t.shape) for t in hf.values()) * WIRE.itemsize
            assert got["sharded_bytes", update] <= model_bytes / plan.server_tp[server] * 1.05


def test_receive_buffers_are_reused_across_updates_only_when_kept():
    kept, fresh = ReceiveBuffers(keep=True), ReceiveBuffers(keep=False)
    a = kept.get(("sharded", 0, 0), 10, torch.bfloat16, "cpu")
    assert kept.get(("sharded", 0, 0), 10, torch.bfloat16, "cpu") is a  # the next update's message 0
    assert kept.get(("sharded", 1, 0), 10, torch.bfloat16, "cpu") is not a  # another message of the update
    assert kept.get(("sharded", 0, 0), 12, torch.bfloat16, "cpu").numel() == 12  # the plan changed: a new one
    assert kept.get(("sharded", 0, 0), 12, torch.float32, "cpu").dtype == torch.float32
    kept.drop()
    assert kept.kept == {}
    b = fresh.get(("sharded", 0, 0), 10, torch.bfloat16, "cpu")
    assert fresh.get(("sharded", 0, 0), 10, torch.bfloat16, "cpu") is not b
    assert fresh.kept == {}
