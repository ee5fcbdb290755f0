"""The chunked torch path of fused_logprobs_entropy against naive torch (matmul -> log_softmax -> gather)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.kernels import fused_logprobs_entropy, logprobs_entropy_naive
from tests.numerics import assert_within, softmax_head_bounds

TOL = dict(atol=1e-5, rtol=1e-5)  # two float32 paths that compute the same way (same ops, other chunks)
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
)
def test_matches_naive_fp32(seed, T, H, rows, pad, temperature, chunk_tokens, chunk_vocab):
    pad = min(pad, rows - 1)
    hidden, weight, labels, vocab, (c_lp, c_ent) = make_case(seed, T, H, rows, pad)

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
    """Large logits: the shifted (m, s, u) form keeps a near-zero entropy accurate."""
    hidden, weight, labels, vocab, (c_lp, c_ent) = make_case(1, 16, 8, 30, 0, scale=8.0)
    got = fused_logprobs_entropy(hidden, weight, labels, chunk_vocab=7, backend="torch")
    want = naive(hidden, weight, labels, 1.0, vocab, dtype=torch.float64)
    torch.testing.assert_close(got[0].double(), want[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[1].double(), want[1], atol=1e-5, rtol=1e-4)


def test_bf16_inputs_compute_in_fp32():
    hidden, weight, labels, vocab, (c_lp, c_ent) = make_case(2, 33, 16, 40, 3)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()

    def fused(h, w):
        return fused_logprobs_entropy(h, w, labels, temperature=0.8, vocab_size=vocab, chunk_tokens=8, chunk_vocab=16)

    logp, ent, dh, dw = loss_and_grads(fused, hidden, weight, c_lp, c_ent)
    assert logp.dtype == ent.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    want = loss_and_grads(lambda h, w: naive(h, w, labels, 0.8, vocab), hidden, weight, c_lp, c_ent)
    torch.testing.assert_close(logp, want[0], **TOL)
    torch.testing.assert_close(ent, want[1], **TOL)
    torch.testing.assert_close(dh, want[2])  # both are fp32 results rounded once to bf16
    torch.testing.assert_close(dw, want[3])


def test_leading_dims_and_frozen_weight():
    hidden, weight, labels, vocab, _ = make_case(3, 12, 8, 20, 0)
    h = hidden.view(3, 4, 8).requires_grad_(True)
    logp, ent = fused_logprobs_entropy(h, weight, labels.view(3, 4), chunk_vocab=6)
    assert logp.shape == ent.shape == (3, 4)
    logp.sum().backward()
    want_lp, _ = naive(hidden, weight, labels, 1.0, vocab)
    torch.testing.assert_close(logp.reshape(-1), want_lp, **TOL)
    assert h.grad.shape == h.shape and weight.grad is None


def test_package_naive_matches_test_naive():
    hidden, weight, labels, vocab, _ = make_case(4, 9, 8, 20, 4)
    package = logprobs_entropy_naive(hidden, weight, labels, 1.3, vocab)
    for a, b in zip(package, naive(hidden, weight, labels, 1.3, vocab)):
        torch.testing.assert_close(a, b, **TOL)


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
