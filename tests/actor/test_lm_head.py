"""The LM head scores only the tokens a loss needs (``where``): same values and gradients there, 0 elsewhere."""

from __future__ import annotations

import torch

from megarl.actor.lm_head import LMHeadOutput
from tests.numerics import assert_within, softmax_head_bounds


def _head(hidden: torch.Tensor, weight: torch.Tensor) -> LMHeadOutput:
    return LMHeadOutput(
        hidden=hidden,
        weight=weight,
        vocab_start=0,
        vocab_size=weight.shape[0],
        tp_group=None,
        reduce_grad_hidden=True,
        backend="torch",
    )


def _grads(where: torch.Tensor | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(12, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (12,), generator=g)
    logp, entropy = _head(hidden, weight).logprobs_entropy(labels, 0.7, where=where)
    mask = torch.ones(12, dtype=torch.bool) if where is None else where
    ((logp * 1.3 - entropy * 0.4) * mask).sum().backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight.grad


def test_where_scores_only_the_selected_tokens():
    """Both heads compute in float32 from the same operands, each within the head's derived bound of
    the exact values, so they differ by at most twice that bound (tests/numerics.py)."""
    where = torch.tensor([False] * 5 + [True] * 4 + [False, True, False])
    full = _grads(None)
    part = _grads(where)
    g_full = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 16, generator=g_full, requires_grad=True)
    weight = torch.randn(50, 16, generator=g_full, requires_grad=True)
    labels = torch.randint(0, 50, (12,), generator=g_full)
    coefs = torch.stack([1.3 * where, -0.4 * where]).float()
    bounds = softmax_head_bounds(hidden.detach(), weight.detach(), labels, coefs, 0.7, torch.float32) * 2
    assert_within(part[0][where], full[0][where], bounds.logprob[where], "logprob of the selected tokens")
    assert_within(part[1][where], full[1][where], bounds.entropy[where], "entropy of the selected tokens")
    assert (part[0][~where] == 0).all() and (part[1][~where] == 0).all()
    # gradients: those of the full head with the unselected tokens' loss masked out
    logp, entropy = _head(hidden, weight).logprobs_entropy(labels, 0.7)
    ((logp * 1.3 - entropy * 0.4) * where).sum().backward()
    assert_within(part[2], hidden.grad, bounds.d_hidden, "d hidden")
    assert_within(part[3], weight.grad, bounds.d_weight, "d weight")
    assert (part[2][~where] == 0).all()


def test_where_nothing_keeps_the_graph():
    logp, entropy, hidden_grad, _ = _grads(torch.zeros(12, dtype=torch.bool))
    assert (logp == 0).all() and (entropy == 0).all() and (hidden_grad == 0).all()
