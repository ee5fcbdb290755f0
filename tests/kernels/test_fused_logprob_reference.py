"""The chunked torch path of fused_logprobs_entropy against naive torch (matmul -> log_softmax -> gather)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.kernels import fused_logprobs_entropy, logprobs_entropy_naive
from tests.numerics import assert_within, softmax_head_bounds, unit_roundoff

OUTPUTS = ("logprob", "entropy", "d_hidden", "d_weight")


def naive(hidden, weight, labels, temperature, vocab_size, dtype=torch.float32):
    """Independent of the package: full logits (fp32 by default) over the real vocabulary."""
    logits = hidden.to(dtype) @ weight[:vocab_size].to(dtype).T / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    hit = (labels >= 0) & (labels < vocab_size)
    logp = logp_all.gather(1, labels.clamp(0, vocab_size - 1)[:, None]).squeeze(1) * hit
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def loss_and_grads(fn, hidden, weight, coef_lp, coef_ent):
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    logp, ent = fn(hidden, weight)
    (coef_lp * logp + coef_ent * ent).sum().backward()
    return logp.detach(), ent.detach(), hidden.grad, weight.grad


def exact_and_bounds(hidden, weight, labels, vocab, coefs, temperature):
    """The four outputs in float64 from the same operands (exact to within float64's roundings), and the
    float32 error bounds of the fused path's (``tests/numerics.py``); d_weight over the real rows."""
    exact = loss_and_grads(
        lambda h, w: naive(h, w, labels, temperature, vocab, dtype=torch.float64),
        hidden.double(),
        weight.double(),
        coefs[0].double(),
        coefs[1].double(),
    )
    exact = (*exact[:3], exact[3][:vocab])
    bounds = softmax_head_bounds(hidden, weight[:vocab], labels, coefs, temperature, torch.float32)
    return exact, [getattr(bounds, name) for name in OUTPUTS]


def bf16_rounded(bound: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """The bound of a float32 result within ``bound`` of ``exact``, then rounded once to bf16."""
    return bound + unit_roundoff(torch.bfloat16) * (exact.abs() + bound)


def make_case(seed, T, H, rows, pad, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(rows, H, generator=g) * scale
    vocab = rows - pad
    labels = torch.randint(-2, vocab + 2, (T,), generator=g)  # a few ignored ids on both ends
    coefs = torch.randn(2, T, generator=g)
    return hidden, weight, labels, vocab, coefs


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    T=st.integers(1, 40),
    H=st.integers(1, 24),
    rows=st.integers(2, 60),
    pad=st.integers(0, 5),
    temperature=st.sampled_from([1.0, 0.6, 1.7]),
    chunk_tokens=st.integers(1, 48),
    chunk_vocab=st.integers(1, 70),
    entropy_term=st.booleans(),
)
def test_matches_naive_fp32(seed, T, H, rows, pad, temperature, chunk_tokens, chunk_vocab, entropy_term):
    """``entropy_term`` False: the entropy's coefficient is 0, the backward's shorter dz."""
    pad = min(pad, rows - 1)
    hidden, weight, labels, vocab, (c_lp, c_ent) = make_case(seed, T, H, rows, pad)
    if not entropy_term:
        c_ent = torch.zeros_like(c_ent)

    def fused(h, w):
        return fused_logprobs_entropy(
            h,
            w,
            labels,
            temperature=temperature,
            vocab_size=vocab,
            chunk_tokens=chunk_tokens,
            chunk_vocab=chunk_vocab,
            backend="torch",
        )

    got = loss_and_grads(fused, hidden, weight, c_lp, c_ent)
    exact = loss_and_grads(
        lambda h, w: naive(h, w, labels, temperature, vocab, dtype=torch.float64),
        hidden.double(),
        weight.double(),
        c_lp.double(),
        c_ent.double(),
    )
    bounds = softmax_head_bounds(hidden, weight[:vocab], labels, torch.stack([c_lp, c_ent]), temperature, torch.float32)
    for name, a, b in zip(OUTPUTS, got, exact):
        if name == "d_weight":
            a, b = a[:vocab], b[:vocab]
        assert_within(a, b, getattr(bounds, name), name)
    assert torch.all(got[3][vocab:] == 0), "padding rows must get zero gradient"


def test_peaked_softmax_entropy_is_accurate():
    """Large logits: the shifted (m, s, u) form keeps a near-zero entropy within its float32 bound."""
    hidden, weight, labels, vocab, coefs = make_case(1, 16, 8, 30, 0, scale=8.0)
    got = fused_logprobs_entropy(hidden, weight, labels, chunk_vocab=7, backend="torch")
    exact, bounds = exact_and_bounds(hidden, weight, labels, vocab, coefs, 1.0)
    for name, a, b, bound in zip(OUTPUTS, got, exact, bounds):
        assert_within(a, b, bound, name)


def test_bf16_inputs_compute_in_fp32():
    """bf16 operands are exact in float32 and float64: the logprob and entropy are within float32's
    bounds, and each gradient within them plus one rounding to bf16."""
    hidden, weight, labels, vocab, coefs = make_case(2, 33, 16, 40, 3)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()

    def fused(h, w):
        return fused_logprobs_entropy(h, w, labels, temperature=0.8, vocab_size=vocab, chunk_tokens=8, chunk_vocab=16)

    logp, ent, dh, dw = loss_and_grads(fused, hidden, weight, *coefs)
    assert logp.dtype == ent.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    exact, bounds = exact_and_bounds(hidden, weight, labels, vocab, coefs, 0.8)
    for name, a, b, bound in zip(OUTPUTS, (logp, ent, dh, dw[:vocab]), exact, bounds):
        assert_within(a, b, bf16_rounded(bound, b) if a.dtype == torch.bfloat16 else bound, name)
    assert not dw[vocab:].any(), "padding rows must get zero gradient"


def test_leading_dims_and_frozen_weight():
    hidden, weight, labels, vocab, coefs = make_case(3, 12, 8, 20, 0)
    h = hidden.view(3, 4, 8).requires_grad_(True)
    logp, ent = fused_logprobs_entropy(h, weight, labels.view(3, 4), chunk_vocab=6)
    assert logp.shape == ent.shape == (3, 4)
    logp.sum().backward()
    exact, bounds = exact_and_bounds(hidden, weight, labels, vocab, coefs, 1.0)
    assert_within(logp.detach().reshape(-1), exact[0], bounds[0], "logprob")
    assert h.grad.shape == h.shape and weight.grad is None


def test_package_naive_matches_test_naive():
    """The package's baseline and this file's run the same float32 operations in the same order on the
    same operands (matrix product, division by the temperature, log_softmax, gather, the entropy's sum),
    so their results are bitwise equal; masking an ignored label by where or by a product gives 0 both ways."""
    hidden, weight, labels, vocab, _ = make_case(4, 9, 8, 20, 4)
    package = logprobs_entropy_naive(hidden, weight, labels, 1.3, vocab)
    for a, b in zip(package, naive(hidden, weight, labels, 1.3, vocab)):
        assert torch.equal(a, b)


def test_each_derived_bound_rejects_an_error_just_above_it():
    """The bounds are not vacuous: the exact outputs with one element moved 1.01 bounds away fail, each
    output's bound on its own (the gradients' with the rounding to bf16), and 0.99 bounds away pass."""
    hidden, weight, labels, vocab, coefs = make_case(2, 33, 16, 40, 3)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    exact, bounds = exact_and_bounds(hidden, weight, labels, vocab, coefs, 0.8)
    bounds = [*bounds[:2], *(bf16_rounded(bound, b) for bound, b in zip(bounds[2:], exact[2:]))]
    for name, want, bound in zip(OUTPUTS, exact, bounds):
        at = int(bound.argmax())
        planted = want.clone()
        planted.view(-1)[at] += 1.01 * bound.view(-1)[at]
        with pytest.raises(AssertionError, match=f"{name}: 1 of"):
            assert_within(planted, want, bound, name)
        planted.view(-1)[at] -= 0.02 * bound.view(-1)[at]
        assert_within(planted, want, bound, name)


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_never_materialises_full_logits():
    T, H, V, ct, cv = 64, 4, 256, 16, 32
    hidden, weight, labels, _, _ = make_case(5, T, H, V, 0)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with _MaxNumel() as probe:
        logp, ent = fused_logprobs_entropy(hidden, weight, labels, chunk_tokens=ct, chunk_vocab=cv)
        (logp + ent).sum().backward()
    # the biggest things alive are the parameters' own gradients ([V,H] = 1024) and chunks
    assert probe.max_numel <= max(V * H, T * H, ct * cv) < T * V


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(backend="triton"), "backend"),
        (dict(backend="cuda"), "backend='cuda'"),
        (dict(chunk_vocab=0), "chunk sizes"),
        (dict(vocab_start=40, vocab_size=30), "no real vocabulary"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    hidden, weight, labels, _, _ = make_case(6, 4, 8, 10, 0)
    with pytest.raises(ValueError, match=match):
        fused_logprobs_entropy(hidden, weight, labels, **kwargs)


def test_rejects_bad_shapes_and_dtypes():
    hidden, weight, labels, _, _ = make_case(7, 4, 8, 10, 0)
    with pytest.raises(ValueError, match="weight"):
        fused_logprobs_entropy(hidden, weight[:, :5], labels)
    with pytest.raises(ValueError, match="labels shape"):
        fused_logprobs_entropy(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match="integer"):
        fused_logprobs_entropy(hidden, weight, labels.float())
