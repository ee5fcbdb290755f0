"""The training path (fused_linear_token_loss: gradients computed inside the forward) against plain
torch autograd on full float64 logits, its FLOP count (6·T·V·H), its memory, and TP=2 over gloo."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.kernels import fused_logprobs_entropy, linear_loss, logprob, reference
from megarl.kernels.linear_loss import (
    GPU_CHUNK_LOGITS_BYTES,
    MIN_CHUNK_TOKENS,
    default_chunk_tokens,
    fused_linear_token_loss,
)
from tests.numerics import assert_within, gamma, softmax_head_bounds, unit_roundoff

from .test_fused_logprob_reference import _MaxNumel, make_case, naive


def _coefs(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, T, generator=g, dtype=torch.float64)


def _terms(coefs: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    """A nonlinear per-token loss of both inputs, as PPO's ratio and an entropy bonus are."""
    a, b, c, d = (x.to(lp.dtype) for x in coefs)
    return a * torch.exp(0.3 * (lp - b)) + c * ent + 0.1 * d * lp * ent


def _fused(hidden, weight, labels, coefs, **kwargs):
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    loss, lp, ent = fused_linear_token_loss(
        hidden, weight, labels, lambda t0, t1, lp, ent: _terms(coefs[:, t0:t1], lp, ent), **kwargs
    )
    loss.backward()
    return loss.detach(), lp, ent, hidden.grad, weight.grad


def _autograd_f64(hidden, weight, labels, coefs, temperature=1.0, vocab_size=None):
    """Plain autograd through the [T, V] float64 logits."""
    hidden = hidden.detach().double().requires_grad_(True)
    weight = weight.detach().double().requires_grad_(True)
    vocab = weight.shape[0] if vocab_size is None else vocab_size
    lp, ent = naive(hidden, weight, labels, temperature, vocab, dtype=torch.float64)
    loss = _terms(coefs, lp, ent).sum()
    loss.backward()
    return loss.detach(), lp.detach(), ent.detach(), hidden.grad, weight.grad


def _bounds(hidden, weight, labels, coefs, temperature, vocab, lp, ent) -> list[torch.Tensor]:
    """float32 error bounds of (loss, logprob, entropy, grad_hidden, grad_weight) (``tests/numerics.py``),
    from the exact ``lp`` and ``ent``. The loss's derivatives are computed in float32 from the float32
    logprob and entropy, so their own errors enter the gradients:
      c0 = dterms/dlp = 0.3 a e + 0.1 d ent (e = exp(0.3 (lp - b))),  c1 = dterms/dent = c + 0.1 d lp
      E_c0 = 0.09 |a| e E_lp + 0.1 |d| E_ent + 8u (|0.3 a e| + |0.1 d ent|),  E_c1 = 0.1 |d| E_lp + 4u (|c| + |0.1 d lp|)
      loss = sum_t terms_t: sum_t (|c0| E_lp + |c1| E_ent) + (8u + gamma(T)) sum_t |each addend of terms_t|."""
    u = unit_roundoff(torch.float32)
    a, b, c, d = coefs
    e = torch.exp(0.3 * (lp - b))
    c0, c1 = 0.3 * a * e + 0.1 * d * ent, c + 0.1 * d * lp
    first = softmax_head_bounds(hidden, weight[:vocab], labels, torch.stack([c0, c1]), temperature, torch.float32)
    e_c0 = (
        0.09 * a.abs() * e * first.logprob
        + 0.1 * d.abs() * first.entropy
        + 8 * u * ((0.3 * a * e).abs() + (0.1 * d * ent).abs())
    )
    e_c1 = 0.1 * d.abs() * first.logprob + 4 * u * (c.abs() + (0.1 * d * lp).abs())
    b2 = softmax_head_bounds(
        hidden, weight[:vocab], labels, torch.stack([c0, c1]), temperature, torch.float32, coef_errors=(e_c0, e_c1)
    )
    addends = (a * e).abs() + (c * ent).abs() + (0.1 * d * lp * ent).abs()
    loss = (c0.abs() * b2.logprob + c1.abs() * b2.entropy).sum() + (
        8 * u + gamma(len(lp), torch.float32)
    ) * addends.sum()
    return [loss, b2.logprob, b2.entropy, b2.d_hidden, b2.d_weight]


def _assert_within_bounds(got, exact, bounds, vocab) -> None:
    for name, a, b, bound in zip(("loss", "logprob", "entropy", "grad_hidden", "grad_weight"), got, exact, bounds):
        if name == "grad_weight":
            a, b = a[:vocab], b[:vocab]
        assert_within(a, b, bound, name)


def _check(got, hidden, weight, labels, coefs, temperature=1.0, vocab=None, factor=1.0) -> list[torch.Tensor]:
    """``got`` (loss, logprob, entropy, grad_hidden, grad_weight) within ``factor`` times the float32 bounds
    of float64 autograd on the same operands; returns the exact values."""
    vocab = weight.shape[0] if vocab is None else vocab
    exact = _autograd_f64(hidden, weight, labels, coefs, temperature, vocab)
    bounds = _bounds(hidden.double(), weight.double(), labels, coefs, temperature, vocab, *exact[1:3])
    _assert_within_bounds(got, exact, [factor * b for b in bounds], vocab)
    return exact


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    T=st.integers(1, 40),
    H=st.integers(1, 24),
    rows=st.integers(2, 60),
    pad=st.integers(0, 5),
    temperature=st.sampled_from([1.0, 0.6, 1.7]),
    chunk_tokens=st.integers(1, 48),
    entropy_term=st.booleans(),
)
def test_matches_autograd_on_float64_logits(seed, T, H, rows, pad, temperature, chunk_tokens, entropy_term):
    """``entropy_term`` False: the loss's entropy coefficients are 0, the torch path's shorter dz."""
    pad = min(pad, rows - 1)
    hidden, weight, labels, vocab, _ = make_case(seed, T, H, rows, pad)
    coefs = _coefs(T, seed)
    if not entropy_term:
        coefs[2:] = 0.0
    got = _fused(hidden, weight, labels, coefs, temperature=temperature, vocab_size=vocab, chunk_tokens=chunk_tokens)
    exact = _autograd_f64(hidden, weight, labels, coefs, temperature, vocab)
    _assert_within_bounds(got, exact, _bounds(hidden, weight, labels, coefs, temperature, vocab, *exact[1:3]), vocab)
    assert torch.all(got[4][vocab:] == 0), "padding rows must get zero gradient"


def test_backward_scales_the_stored_gradients_by_grad_output():
    hidden, weight, labels, vocab, _ = make_case(1, 20, 8, 30, 2)
    coefs = _coefs(20, 1)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss, _, _ = fused_linear_token_loss(
        h, w, labels, lambda t0, t1, lp, ent: _terms(coefs[:, t0:t1], lp, ent), vocab_size=vocab, chunk_tokens=7
    )
    (-2.5 * loss).backward()
    exact = _autograd_f64(hidden, weight, labels, coefs, vocab_size=vocab)
    bounds = _bounds(hidden.double(), weight.double(), labels, coefs, 1.0, vocab, *exact[1:3])
    u = unit_roundoff(torch.float32)
    for name, got, want, bound in (
        ("grad_hidden", h.grad, exact[3], bounds[3]),
        ("grad_weight", w.grad, exact[4], bounds[4]),
    ):
        want = -2.5 * want  # the stored gradient times grad_output: one more rounding
        rows = slice(None) if name == "grad_hidden" else slice(0, vocab)
        assert_within(got[rows], want[rows], 2.5 * bound[rows] + u * want[rows].abs(), name)


def test_bf16_operands_give_bf16_gradients_of_the_fp32_computation(monkeypatch):
    """The bf16 operands, exactly as float64, are the reference's; the computation is float32's
    (within its bound) and each gradient is then rounded once to bf16 (u_bf16 = 2^-9 relative).
    (The gradient GEMMs in fp32, as on a CPU without native bf16.)"""
    monkeypatch.setattr(linear_loss, "_bf16_grads", lambda hidden, weight: False)
    (hidden, weight, labels, coefs, vocab), got, exact, bounds = _bf16_case(33)
    u16 = unit_roundoff(torch.bfloat16)
    for name, a, b, bound in (
        ("grad_hidden", got[3], exact[3], bounds[3]),
        ("grad_weight", got[4][:vocab], exact[4][:vocab], bounds[4]),
    ):
        assert_within(a, b, bound + u16 * (b.abs() + bound), name)


@pytest.mark.parametrize("T", [20, 33], ids=["dW in the backward (T <= 2H)", "dW accumulated (T > 2H)"])
def test_bf16_gradient_gemms_round_dz_to_bf16(monkeypatch, T):
    """With native bf16 (``_bf16_grads``) dz is rounded to bf16 and the gradient GEMMs take bf16
    operands, their products exact and summed in fp32: on top of the float32 bound, each dz's
    rounding (u_bf16 of each |dz_v| |w_v| or |dz_t| |h_t| term), the GEMM's bf16 result and the final
    bf16 gradient (u_bf16 each). dW is one GEMM in the backward from the kept dz when the micro-batch
    has at most 2H tokens, else accumulated over the chunks in fp32."""
    monkeypatch.setattr(linear_loss, "_bf16_grads", lambda hidden, weight: True)
    (hidden, weight, labels, coefs, vocab), got, exact, bounds = _bf16_case(T)
    dz = _logit_grads_f64(hidden, weight, labels, coefs, 0.8, vocab).abs()
    h, w = hidden.double().abs(), weight[:vocab].double().abs()
    u16 = unit_roundoff(torch.bfloat16)
    for name, a, b, bound, terms in (
        ("grad_hidden", got[3], exact[3], bounds[3], dz @ w),
        ("grad_weight", got[4][:vocab], exact[4][:vocab], bounds[4], dz.T @ h),
    ):
        assert_within(a, b, bound + 2 * u16 * (terms + b.abs() + bound), name)
    assert torch.all(got[4][vocab:] == 0), "padding rows must get zero gradient"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("path", ["training", "no-grad"])
def test_logits_gemms_of_bf16_operands_run_in_bf16_products(monkeypatch, dtype, path):
    """On a CPU with native bf16 the logits GEMMs of bf16 hidden states and weights (fp32 copies of
    bf16 values) run in oneDNN's bf16 math mode, exact products at bf16's rate (the bf16 tests above
    and in test_fused_logprob_reference hold their results to the float32 bound); fp32 operands
    keep the mode they had, and it is put back afterwards."""
    monkeypatch.setattr(logprob, "cpu_bf16_native", lambda: (True, "native bf16 (test)"))
    module = linear_loss if path == "training" else reference  # where each path's GEMM is looked up
    modes, gemm = [], module._scaled_logits

    def spy(h_c, w_c, inv_tau):
        modes.append(torch.backends.mkldnn.matmul.fp32_precision)
        return gemm(h_c, w_c, inv_tau)

    monkeypatch.setattr(module, "_scaled_logits", spy)
    before = torch.backends.mkldnn.matmul.fp32_precision
    hidden, weight, labels, vocab, _ = make_case(2, 20, 16, 40, 3)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    if path == "training":
        _fused(hidden, weight, labels, _coefs(20, 2), vocab_size=vocab, chunk_tokens=8)
    else:
        with torch.no_grad():
            fused_logprobs_entropy(hidden, weight, labels, vocab_size=vocab, backend="torch")
    assert modes and set(modes) == {"bf16" if dtype == torch.bfloat16 else before}
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def test_bf16_products_puts_the_mode_back_after_an_error():
    before = torch.backends.mkldnn.matmul.fp32_precision
    with pytest.raises(RuntimeError), reference.bf16_products():
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        raise RuntimeError("inside")
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def _bf16_case(T: int):
    """bf16 operands (H 16, 40 rows of which 37 the vocabulary) through the training path in chunks of 8
    tokens: ``(operands, got, exact, bounds)``, the loss, logprob and entropy already checked within
    their float32 bounds and both gradients checked to be bf16."""
    hidden, weight, labels, vocab, _ = make_case(2, T, 16, 40, 3)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    coefs = _coefs(T, 2)
    got = _fused(hidden, weight, labels, coefs, temperature=0.8, vocab_size=vocab, chunk_tokens=8)
    assert got[3].dtype == got[4].dtype == torch.bfloat16
    exact = _autograd_f64(hidden, weight, labels, coefs, 0.8, vocab)
    bounds = _bounds(hidden.double(), weight.double(), labels, coefs, 0.8, vocab, *exact[1:3])
    for name, a, b, bound in zip(("loss", "logprob", "entropy"), got, exact, bounds):
        assert_within(a, b, bound, name)
    return (hidden, weight, labels, coefs, vocab), got, exact, bounds


def _logit_grads_f64(hidden, weight, labels, coefs, temperature, vocab) -> torch.Tensor:
    """d loss / d (h . w^T) ``[T, vocab]`` in float64: the dz the gradient GEMMs take."""
    logits = (hidden.double() @ weight[:vocab].double().T).requires_grad_(True)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    hit = (labels >= 0) & (labels < vocab)
    lp = logp_all.gather(1, labels.clamp(0, vocab - 1)[:, None]).squeeze(1) * hit
    ent = -(logp_all.exp() * logp_all).sum(-1)
    (dz,) = torch.autograd.grad(_terms(coefs, lp, ent).sum(), logits)
    return dz


class _MatmulFlops(TorchDispatchMode):
    """2·m·n·k of every matrix product, in-place ones included (FlopCounterMode skips addmm_)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_", "matmul", "bmm"):
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        return func(*args, **(kwargs or {}))


def test_flops_are_six_t_v_h_where_recomputing_in_backward_costs_eight():
    T, H, V = 64, 32, 96
    hidden, weight, labels, _, _ = make_case(3, T, H, V, 0)
    coefs = _coefs(T, 3)

    def count(fn) -> int:
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with _MatmulFlops() as counter:
            fn(h, w).backward()
        return counter.flops

    def training_path(h, w):
        return fused_linear_token_loss(
            h, w, labels, lambda t0, t1, lp, ent: _terms(coefs[:, t0:t1], lp, ent), chunk_tokens=16
        )[0]

    def logprobs_then_loss(h, w):
        lp, ent = fused_logprobs_entropy(h, w, labels, chunk_tokens=16, chunk_vocab=32, backend="torch")
        return _terms(coefs, lp, ent).sum()

    assert count(training_path) == 6 * T * V * H
    assert count(logprobs_then_loss) == 8 * T * V * H


def test_memory_is_bounded_by_a_chunk():
    T, H, V, ct = 64, 4, 256, 8
    hidden, weight, labels, _, _ = make_case(5, T, H, V, 0)
    coefs = _coefs(T, 5)
    with _MaxNumel() as probe:
        _fused(hidden, weight, labels, coefs, chunk_tokens=ct)
    # the parameters' gradients ([V,H] = 1024) and one chunk of logits [ct,V] = 2048 < [T,V]
    assert probe.max_numel <= max(V * H, T * H, ct * V) < T * V


def test_default_chunk_holds_about_the_hidden_states():
    assert default_chunk_tokens(8192, 152064 // 2, 4096) == 512  # V/H -> 19, 8192/19 -> 432 -> 512
    assert default_chunk_tokens(512, 152064, 256) == 256  # not 1: each chunk passes over all of dW
    assert default_chunk_tokens(5, 1000, 64) == 5
    assert default_chunk_tokens(100, 10, 64) == 100  # V < H: one chunk


def test_gpu_chunk_is_the_most_tokens_whose_logits_fit_the_budget():
    """On a GPU the per-chunk dW pass and launches, not the GEMMs, cost the small chunks (H200:
    chunks of 256 tokens ran at 0.15-0.88 of the recompute path): chunks fill the budget."""
    budget = GPU_CHUNK_LOGITS_BYTES
    for T, V, H in [(4096, 32768, 2048), (32768, 152064, 4096), (16384, 38016, 2048), (8192, 151936, 1536)]:
        tokens = default_chunk_tokens(T, V, H, on_gpu=True)
        assert tokens == T or tokens * V * 4 <= budget < (tokens + MIN_CHUNK_TOKENS) * V * 4, (T, V, H, tokens)
        assert tokens % MIN_CHUNK_TOKENS == 0 or tokens == T
    assert default_chunk_tokens(4096, 32768, 2048, on_gpu=True) == 4096  # was 256: 16 passes over dW
    assert default_chunk_tokens(32768, 152064, 4096, on_gpu=True) == 1536  # 0.87 GiB of logits
    assert default_chunk_tokens(100, 10**9, 64, on_gpu=True) == 100  # at least MIN_CHUNK_TOKENS, at most T
    assert default_chunk_tokens(100, 32768, 2048) == 100  # the host keeps Liger's choice
    assert default_chunk_tokens(4096, 32768, 2048) == 256


def test_ignored_labels_give_no_logprob_gradient():
    hidden, weight, labels, vocab, _ = make_case(6, 10, 8, 20, 0)
    labels[:] = -100
    got = _fused(hidden, weight, labels, _coefs(10, 6), chunk_tokens=3)
    assert torch.all(got[1] == 0)
    _check(got, hidden, weight, labels, _coefs(10, 6))


# ------------------------------------------------------------------------ TP = 2 over gloo

WORLD = 2
TP_CASES = [(6, 11), (4, 3)]  # rows per rank, real vocab: rank 1 padded; then rank 1 all padding


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group([0, 1])
        for rows, vocab in TP_CASES:
            g = torch.Generator().manual_seed(rows * 100 + vocab)
            T, H = 13, 8
            hidden = torch.randn(T, H, generator=g)
            weight = torch.randn(rows * WORLD, H, generator=g) * 0.7  # [V_padded,H]
            labels = torch.randint(0, vocab, (T,), generator=g)
            labels[0], labels[1] = -100, vocab - 1
            coefs = _coefs(T, rows)
            want = _autograd_f64(hidden, weight, labels, coefs, 0.8, vocab)
            bounds = _bounds(hidden.double(), weight.double(), labels, coefs, 0.8, vocab, *want[1:3])
            shard = weight[rank * rows : (rank + 1) * rows]
            kwargs = dict(tp_group=group, temperature=0.8, vocab_size=vocab, chunk_tokens=5)
            got = _fused(hidden, shard, labels, coefs, **kwargs)
            own = slice(rank * rows, min((rank + 1) * rows, vocab))  # this rank's real vocabulary rows
            n_own = max(own.stop - own.start, 0)
            # the shards' partial sums meet in an all-reduce: twice the bound (each part within one)
            for name, a, b, bound in zip(("loss", "logprob", "entropy", "grad_hidden"), got, want, bounds):
                assert_within(a, b, 2 * bound, name)
            assert_within(got[4][:n_own], want[4][own], 2 * bounds[4][own], "grad_weight")
            assert torch.all(got[4][n_own:] == 0), "padding rows get no gradient"
            partial = _fused(hidden, shard, labels, coefs, reduce_grad_hidden=False, **kwargs)[3]
            dist.all_reduce(partial, group=group)
            assert_within(partial, want[3], 2 * bounds[3], "summed partial grad_hidden")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_two_rank_vocab_parallel_equals_float64_autograd():
    mp.spawn(_tp_worker, args=(_free_port(),), nprocs=WORLD, join=True)
