"""The LM head scores only the tokens a loss needs (``where``): same values and gradients there, 0 elsewhere."""

from __future__ import annotations

import torch

from megarl.actor.lm_head import LMHeadOutput


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
    where = torch.tensor([False] * 5 + [True] * 4 + [False, True, False])
    full = _grads(None)
    part = _grads(where)
    assert torch.allclose(part[0][where], full[0][where], atol=1e-6)
    assert torch.allclose(part[1][where], full[1][where], atol=1e-6)
    assert (part[0][~where] == 0).all() and (part[1][~where] == 0).all()
    # gradients: those of the full head with the unselected tokens' loss masked out
    g_full = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 16, generator=g_full, requires_grad=True)
    weight = torch.randn(50, 16, generator=g_full, requires_grad=True)
    labels = torch.randint(0, 50, (12,), generator=g_full)
    logp, entropy = _head(hidden, weight).logprobs_entropy(labels, 0.7)
    ((logp * 1.3 - entropy * 0.4) * where).sum().backward()
    assert torch.allclose(part[2], hidden.grad, atol=1e-6) and torch.allclose(part[3], weight.grad, atol=1e-6)
    assert (part[2][~where] == 0).all()


def test_where_nothing_keeps_the_graph():
    logp, entropy, hidden_grad, _ = _grads(torch.zeros(12, dtype=torch.bool))
    assert (logp == 0).all() and (entropy == 0).all() and (hidden_grad == 0).all()
