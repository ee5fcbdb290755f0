"""bf16 emulation (``actor.emulate_bf16``): bf16 storage and roundings, matrix products in fp32.

On a CPU without native bf16 the learning checks train in bf16 through this emulation, so it
must round where the native path rounds: each emulated product equals the fp32 product of the
bf16 operands rounded to bf16, and a whole engine agrees with native bf16 far more closely than
either agrees with fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megarl.actor.bf16_emulation import emulated_bf16_matmuls
from megarl.config.train import TrainEngineConfig
from megarl.utils.hardware import cpu_bf16_native
from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_batch


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize(
    "op",
    [
        lambda a, b, c: a @ b,
        lambda a, b, c: torch.addmm(c, a, b),
        lambda a, b, c: torch.bmm(a[None].expand(3, -1, -1), b[None].expand(3, -1, -1)),
        lambda a, b, c: torch.baddbmm(c[None], a[None], b[None]),
        lambda a, b, c: F.linear(a, b.t(), c[0]),
    ],
    ids=["mm", "addmm", "bmm", "baddbmm", "linear"],
)
def test_a_product_is_the_fp32_product_rounded_to_bf16(op):
    a, b, c = _bf16(33, 70, seed=1), _bf16(70, 20, seed=2), _bf16(33, 20, seed=3)
    with emulated_bf16_matmuls():
        got = op(a, b, c)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, op(a.float(), b.float(), c.float()).to(torch.bfloat16))


def test_attention_runs_as_it_is():
    """Attention is left to PyTorch's CPU kernel (bf16 at fp32 speed, native roundings)."""
    q, k, v = (_bf16(2, 4, 16, 64, seed=s) for s in (1, 2, 3))
    with emulated_bf16_matmuls():
        emulated = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(emulated, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_fp32_products_are_untouched():
    a, b = _bf16(8, 8).float(), _bf16(8, 8, seed=1).float()
    with emulated_bf16_matmuls():
        assert torch.equal(a @ b, a @ b) and (a @ b).dtype == torch.float32


def test_config_asks_for_bf16():
    cfg = TrainEngineConfig(dtype="float32", emulate_bf16=True)
    with pytest.raises(ValueError, match="emulate_bf16.*dtype=bfloat16"):
        cfg.check()


@pytest.mark.multiproc
@pytest.mark.skipif(not cpu_bf16_native()[0], reason="compares with native bf16, which this CPU lacks")
def test_engine_matches_native_bf16_far_closer_than_fp32(tiny_model_dir):
    """Logprobs and gradients of a tiny model: emulated vs native bf16 differ by a small fraction
    of what separates bf16 from fp32 (only the fp32 summation order differs)."""
    model = str(tiny_model_dir("llama"))
    batch = make_batch([30, 21, 17], seed=5)
    run = lambda **kw: run_ranks(
        1, "tests.actor.workers:bf16_logp_and_grads", model_dir=model, alloc="d1p1t1", batch=batch, **kw
    )[0]
    native, emulated, fp32 = run(dtype="bfloat16"), run(dtype="bfloat16", emulate=True), run(dtype="float32")
    mask = batch["attention_mask"].clone()
    mask[:, -1] = False
    # Each emulated product differs from the native one in ~1e-4 of its elements (summation
    # order); the backward, a chain of bf16-rounded products, spreads those flips further than
    # the forward does, hence the looser bound on the gradients (measured: 0.05x and 0.43x).
    for key, bound in (("logp", 0.1), ("grads", 0.6)):
        pick = (lambda t: t[mask]) if key == "logp" else (lambda t: t)
        emu_gap = (pick(emulated[key]) - pick(native[key])).abs().mean()
        dtype_gap = (pick(fp32[key]) - pick(native[key])).abs().mean()
        assert emu_gap < bound * dtype_gap, f"{key}: emulated-native {emu_gap:.3g} vs fp32-native {dtype_gap:.3g}"
