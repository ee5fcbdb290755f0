"""benchmarks/actor_step.py: the MFU arithmetic and the GPU table's rows, checked on CPU."""

import pytest
import torch

from benchmarks import actor_step

# hidden, layers, heads, kv_heads, intermediate, vocab, sequences, seq_len
SHAPE = (64, 2, 4, 2, 128, 1000, 3, 10)


def test_flops_per_token_by_hand():
    # per layer: q 64x64 + k, v 64x32 each + o 64x64 = 12288; MLP 3 x 64 x 128 = 24576
    params = 2 * (12288 + 24576) + 1000 * 64
    attention = 6 * 2 * 10 * 64
    assert actor_step._flops_per_token(SHAPE) == 6 * params + attention


def test_mfu_is_model_flops_over_the_peak():
    tflops, util = actor_step.mfu(SHAPE, step_s=0.5, peak_flops=1e9)
    flops = actor_step._flops_per_token(SHAPE) * 30 / 0.5
    assert tflops == pytest.approx(flops / 1e12) and util == pytest.approx(flops / 1e9)
    # the Qwen2.5-1.5B shape of the kit: 9.8 GFLOP per token, so a 32k-token step in 0.72 s is about
    # 45% of an H100's 989 TFLOP/s
    _, util = actor_step.mfu(actor_step.GPU_SHAPES["qwen2.5-1.5b"], step_s=0.72)
    assert 0.40 < util < 0.50
    with pytest.raises(ValueError, match="step_s must be positive, got 0"):
        actor_step.mfu(SHAPE, 0)


def test_gpu_row_columns():
    row = actor_step.gpu_row("s", SHAPE, True, 0.25, 12.5, (1e-2, 1e-3))
    assert row["tokens/step"] == 30 and row["tokens/s"] == 120 and row["fused_kernels"] is True
    assert row["MFU"] == actor_step.mfu(SHAPE, 0.25)[1] and row["peak_GiB"] == 12.5
    assert (row["logp_max_abs_diff"], row["logp_mean_abs_diff"]) == (1e-2, 1e-3)
    assert "logp_max_abs_diff" not in actor_step.gpu_row("s", SHAPE, False, 0.25, 12.5)


def test_logprob_gap_counts_masked_in_positions_only():
    ours = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -5.0, 0.0]])
    theirs = torch.tensor([[-1.5, -2.0, 9.0], [-1.0, -4.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    assert actor_step.logprob_gap(ours, theirs, mask) == (1.0, pytest.approx(0.375))
    with pytest.raises(ValueError, match="logprob shapes differ"):
        actor_step.logprob_gap(ours, theirs[:1], mask)


def test_actor_rows_run_the_gpu_steps_on_cpu():
    """The GPU path's steps (two engines sharing the groups, export to HF, logprob comparison) on
    gloo with a tiny fp32 model: the fused flag is None (auto: torch on CPU) then False."""
    shape = (64, 2, 4, 2, 128, 512, 4, 32)
    rows = actor_step.actor_rows("tiny", shape, "float32", steps=1, fused_flags=(None, False))
    assert [r["fused_kernels"] for r in rows] == [None, False]
    assert all(r["step_s"] > 0 and 0 < r["MFU"] for r in rows)
    assert rows[0]["logp_max_abs_diff"] < 1e-4  # same weights, fp32: HF and Megatron agree
    assert "logp_max_abs_diff" not in rows[1]
    # each row says which path its logprob head ran, and why: on CPU the torch path
    assert [r["kernel_path"] for r in rows] == ["torch", "torch"]
    assert rows[0]["selfcheck"] == "torch (no CUDA device is available)"
    assert rows[1]["selfcheck"] == "torch (use_fused_kernels=False)"


def test_shape_and_fused_filters_pick_the_gpu_rows_and_name_the_table(monkeypatch):
    from benchmarks import actor_step

    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(actor_step, "_row_in_own_process", lambda name, shape, fused, steps: ran.append((name, fused)))
    actor_step._run_gpu(quick=False)
    assert ran == [(name, fused) for name in actor_step.GPU_SHAPES for fused in (False, True)]
    assert actor_step.results_name() == "actor_step_gpu"
    ran.clear()
    monkeypatch.setenv(actor_step.SHAPE_ENV, "qwen2.5-1.5b")
    monkeypatch.setenv(actor_step.FUSED_ENV, "on")
    actor_step._run_gpu(quick=True)  # the shape asked for wins over --quick's
    assert ran == [("qwen2.5-1.5b", True)]
    assert actor_step.results_name() == "actor_step_gpu_qwen2.5-1.5b"
