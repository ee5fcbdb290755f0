"""benchmarks/cta_order_model.py: its traffic accounting at the two limits, and the order it models.

The order itself is checked against the kernels' grid (csrc/cta_order.cuh) on the emulator in
tests/kernels/test_kernels_emulated.py."""

from __future__ import annotations

import pytest

from benchmarks import cta_order_model as model

SHAPE = (4096, 2048, 32768)  # 32 token blocks x 128 vocab tiles of 256 (16 splits of 8 tiles)


@pytest.mark.parametrize("group", [1, 16])
def test_an_l2_that_holds_everything_reads_each_input_byte_once(group):
    T, H, V = SHAPE
    assert model.dram_gb(T, H, V, group, l2_mb=1e6, jitter=0.0) == pytest.approx((T + V) * H * 2 / 1e9)


@pytest.mark.parametrize("group", [1, 16])
def test_without_l2_every_tile_reads_its_hidden_and_weight_rows(group):
    T, H, V = SHAPE
    tiles = (T // 128) * (V // 256)
    assert model.dram_gb(T, H, V, group, l2_mb=0, jitter=0.0) == pytest.approx(tiles * (128 + 256) * H * 2 / 1e9)


def test_groups_of_token_blocks_read_less_than_the_column_fastest_order():
    T, H, V = SHAPE
    for l2_mb, jitter in model.SETTINGS.values():
        assert model.dram_gb(T, H, V, 16, l2_mb, jitter) < 0.7 * model.dram_gb(T, H, V, 1, l2_mb, jitter)


def test_the_launch_order_takes_each_tile_once():
    order = model.launch_order(5, 7, 3)
    assert sorted(order) == [(c, r) for c in range(5) for r in range(7)]
    assert order[:6] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_quick_rows_and_summary():
    rows = model.run(quick=True)
    assert [(r["group"], r["vs_group_1"] == 1.0) for r in rows[:2]] == [(1, True), (16, False)]
    assert len(rows) == 2 * len(model.SETTINGS)
    assert "group 16 moves" in model.summary(rows)


def test_the_measured_forward_times_come_from_the_committed_gpu_results(tmp_path):
    measured = model.measured_forward_ms()
    assert set(measured) == set(model.GPU_SHAPES)  # the 12 TP-1 shapes, megarl's kernels
    assert 5 < measured[model.PROFILED] < 10  # ms: the profiled shape, 7.65 ms on the H200
    assert model.measured_forward_ms(tmp_path / "absent.json") == {}
    row = model.run(quick=True)[0]
    assert row["dram_ms"] == pytest.approx(row["dram_GB"] / 4.8, abs=0.01)
    assert row["measured_fwd_ms"] == round(measured[4096, 2048, 32768], 2)
