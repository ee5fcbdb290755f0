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
    row = actor_step.gpu_row("s", SHAPE, True, 0.25, 12.5, (1e-2, 1e-3), step_times=[0.3, 0.25, 0.2])
    assert row["tokens/step"] == 30 and row["tokens/s"] == 120 and row["fused_kernels"] is True
    assert (row["step_s_min"], row["step_s_max"], row["head"]) == (0.2, 0.3, "megarl")
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
    """The GPU path's steps (three engines sharing the groups, export to HF, logprob comparison) on
    gloo with a tiny fp32 model: the fused flag None (auto: torch on CPU), False, then stock
    Megatron-LM's head; the same first loss in each (same initial weights, same batch)."""
    shape = (64, 2, 4, 2, 128, 512, 4, 32)
    rows = actor_step.actor_rows("tiny", shape, "float32", steps=2, heads=(None, False, actor_step.STOCK))
    assert [(r["head"], r["fused_kernels"]) for r in rows] == [("megarl", None), ("megarl", False), ("megatron", None)]
    assert all(r["step_s_min"] <= r["step_s"] <= r["step_s_max"] and 0 < r["MFU"] for r in rows)
    assert rows[0]["logp_max_abs_diff"] < 1e-4  # same weights, fp32: HF and Megatron agree
    assert "logp_max_abs_diff" not in rows[1]
    # the stock head computes the same loss as megarl's training path: fp32 sums over 124 tokens
    losses = [r["first_loss"] for r in rows]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[2] == pytest.approx(losses[0], rel=1e-5)
    assert 5.0 < losses[0] < 7.5  # about log(512) from random init
    # each row says which path its logprob head ran, and why: on CPU the torch path
    assert [r["kernel_path"] for r in rows] == ["torch", "torch", "torch"]
    assert rows[0]["selfcheck"] == "torch (no CUDA device is available)"
    assert rows[1]["selfcheck"] == "torch (use_fused_kernels=False)"


def test_kernel_kinds_and_the_profile_rows():
    assert actor_step.kernel_kind("void megarl::logprob_forward_sm90_kernel<true>(...)") == "head"
    assert actor_step.kernel_kind("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN") == "gemm"
    assert actor_step.kernel_kind("flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert actor_step.kernel_kind("multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor>") == "optimizer"
    assert actor_step.kernel_kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert actor_step.kernel_kind("vectorized_elementwise_kernel<4, CUDAFunctor_add>") == "elementwise/other"
    kernels = {"nvjet_a": 6.0, "flash_fwd": 2.0, "nvjet_b": 1.0, "elementwise_x": 1.0}
    rows = actor_step.top_kernel_rows("s", "megarl", True, kernels, top=2)
    assert [(r["kernel"], r["share"]) for r in rows[:2]] == [("nvjet_a", 0.6), ("flash_fwd", 0.2)]
    assert {r["kernel"]: r["ms"] for r in rows[2:]} == {
        "all gemm": 7.0,
        "all attention": 2.0,
        "all elementwise/other": 1.0,
    }
    assert all(r["impl"] == "profile" and r["head"] == "megarl" for r in rows)


def test_shape_and_fused_filters_pick_the_gpu_rows_and_name_the_table(monkeypatch):
    from benchmarks import actor_step

    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        actor_step,
        "_rows_in_own_process",
        lambda name, shape, which, steps, profile: ran.append((name, which, profile)) or [{}],
    )
    actor_step._run_gpu(quick=False)
    assert ran == [(name, fused, False) for name in actor_step.GPU_SHAPES for fused in (False, True)]
    assert actor_step.results_name() == "actor_step_gpu"
    ran.clear()
    monkeypatch.setenv(actor_step.SHAPE_ENV, "qwen2.5-1.5b")
    monkeypatch.setenv(actor_step.FUSED_ENV, "on,stock")
    monkeypatch.setenv(actor_step.PROFILE_ENV, "1")
    actor_step._run_gpu(quick=True)  # the shape asked for wins over --quick's
    assert ran == [("qwen2.5-1.5b", True, True), ("qwen2.5-1.5b", actor_step.STOCK, True)]
    assert actor_step.results_name() == "actor_step_gpu_qwen2.5-1.5b"
    monkeypatch.setenv(actor_step.FUSED_ENV, "sometimes")
    with pytest.raises(ValueError, match="MEGARL_ACTOR_STEP_FUSED must be one of .* got 'sometimes'"):
        actor_step._run_gpu(quick=True)
