"""benchmarks/bridge_smoke.py on CPU (gloo): the same code as on a GPU (NCCL), a small checkpoint."""

from __future__ import annotations

import math

from safetensors import safe_open

from benchmarks import bridge_smoke


def test_the_group_works_and_the_sender_packs_every_weight_once(tmp_path):
    rows = bridge_smoke.run(quick=True)
    group, send = rows
    assert group["case"] == "group" and group["backend"] == "gloo" and group["collectives_ok"] is True
    bridge_smoke.write_checkpoint(tmp_path, bridge_smoke.SHAPES["small"])
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        weights = sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys())  # noqa: SIM118
    assert send["GB"] * 1e9 == weights * 2  # every HF tensor once, in the bf16 wire dtype
    assert send["error"] is None and send["buckets"] >= 1 and send["GB_per_s"] > 0
    assert send["send_s_min"] <= send["send_s"] <= send["send_s_max"]


def test_results_are_named_by_device(monkeypatch):
    monkeypatch.setattr(bridge_smoke.torch.cuda, "is_available", lambda: True)
    assert bridge_smoke.results_name() == "bridge_smoke_gpu"
