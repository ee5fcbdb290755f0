"""benchmarks/profile_forward.py --sweep: its rows and ratios, and that each row ran in its own CTA order
(the timings are the GPU's; here they are stand-ins that report the order they ran under)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import fused_logprob, profile_forward
from megarl.kernels import _cuda


@pytest.fixture
def stand_ins(monkeypatch):
    """CPU inputs, no-op steps, and timings that read the CTA order in force: group g takes 10 + g ms
    of op time and 8 + g ms of kernel time; cuBLAS 9 ms and 8 ms."""
    monkeypatch.delenv("MEGARL_CUDA_CTA_GROUP", raising=False)
    monkeypatch.setattr(fused_logprob, "_inputs", lambda T, H, V, dtype, device: (torch.zeros(1), torch.zeros(1), None))
    monkeypatch.setattr(fused_logprob, "_step", lambda *args, **kwargs: None)
    monkeypatch.setattr(_cuda, "active_path", lambda device=None: "sm90")

    def group() -> int | None:
        value = os.environ.get("MEGARL_CUDA_CTA_GROUP")
        return None if value is None else int(value)

    def op_times(variant, hidden, weight, labels, backward, repeats):  # as fused_logprob._measure_gpu
        return ([9.0] * repeats if group() is None else [10.0 + group(), 11.0 + group()]), None

    monkeypatch.setattr(fused_logprob, "_measure_gpu", op_times)
    monkeypatch.setattr(profile_forward, "_kernel_ms", lambda fn, repeats, name: 8.0 if name is None else 8.0 + group())


def test_each_group_is_timed_in_its_own_order_and_the_variable_is_restored(stand_ins):
    written = []
    rows = profile_forward.sweep(
        [(256, 4096, 1024), (256, 8192, 1024)], repeats=2, groups=(1, 16, 32), on_rows=lambda r: written.append(len(r))
    )
    assert "MEGARL_CUDA_CTA_GROUP" not in os.environ
    assert written == [4, 8]  # after each shape
    fused = {(r["H"], r["group"]): r for r in rows if r["variant"] != "cublas"}
    assert fused[(4096, 16)]["op_ms"] == pytest.approx(26.5) and fused[(4096, 16)]["op_ms_min"] == 26.0
    assert fused[(4096, 16)]["kernel_ms"] == 24.0
    assert fused[(4096, 32)]["kernel_vs_cublas"] == pytest.approx(8.0 / 40.0)
    assert fused[(4096, 1)]["op_vs_cublas"] == pytest.approx(9.0 / 11.5)
    assert [k for k, r in fused.items() if r["default"]] == [(4096, 32), (8192, 16)]  # _cuda.cta_group(H)
    assert {r["kernel_path"] for r in fused.values()} == {"sm90"}


def test_an_operators_setting_is_swept_over_and_restored(stand_ins, monkeypatch):
    monkeypatch.setenv("MEGARL_CUDA_CTA_GROUP", "4")
    rows = profile_forward.sweep([(256, 4096, 1024)], repeats=2, groups=(1, 4))
    assert os.environ["MEGARL_CUDA_CTA_GROUP"] == "4"
    assert [r["kernel_ms"] for r in rows] == [8.0, 9.0, 12.0]


def test_sweep_rows_tflops_and_summary():
    row = profile_forward.sweep_row(1024, 1024, 1024, "cuda group 1", [2.0, 1.0, 4.0], 1.0)
    assert (row["op_ms"], row["op_ms_min"], row["op_ms_max"]) == (2.0, 1.0, 4.0)
    assert row["kernel_TFLOP/s"] == pytest.approx(2 * 1024**3 / 1e-3 / 1e12)
    rows = profile_forward.with_ratios(
        [profile_forward.sweep_row(1024, 1024, 1024, "cublas", [1.0], 0.9), dict(row, group=1)]
    )
    assert "group 1: kernel 0.90-0.90 of cuBLAS (median 0.90) over 1 shapes." == profile_forward.summary(rows)
