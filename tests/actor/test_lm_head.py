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


CANDIDATES = torch.tensor([[3, 7, 49, 0, 12]] * 6 + [[-1, 50, 8, 8, 2]] * 5 + [[-1, 60, -3, 55, 50]])
"""5 candidate ids for each of 12 tokens: valid ones, ids outside the vocabulary (0 for them), a repeated
id, and a last token without any valid candidate."""


def _candidate_case(dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(12, 16, generator=g).to(dtype)
    weight = (torch.randn(50, 16, generator=g) * 0.5).to(dtype)
    return hidden, weight


def _candidate_reference(hidden, weight, temperature):
    """float64 logprobs of CANDIDATES from the full log-softmax, with the float32 path's error bound:
    the anchor's logprob (the fused head's bound), the two logits' H-term dot products and their
    division by the temperature (gamma(H + 1) each), and the three subtractions that form the result."""
    from tests.numerics import gamma, unit_roundoff

    h, w = hidden.double(), weight.double()
    z = h @ w.T / temperature
    logp = z.log_softmax(-1)
    valid = (CANDIDATES >= 0) & (CANDIDATES < w.shape[0])
    ids = CANDIDATES.clamp(0, w.shape[0] - 1)
    anchor = torch.where(valid, CANDIDATES, w.shape[0]).min(1).values.clamp(max=w.shape[0] - 1)
    want = logp.gather(1, ids) * valid
    coefs = torch.stack([torch.ones(12), torch.zeros(12)])
    lp_bound = softmax_head_bounds(h, w, anchor, coefs, temperature, torch.float32).logprob
    sums = h.abs() @ w.abs().T / temperature
    z_a, lp_a = z.gather(1, anchor[:, None]), logp.gather(1, anchor[:, None])
    u = unit_roundoff(torch.float32)
    bound = lp_bound[:, None] + gamma(17, torch.float32) * (sums.gather(1, anchor[:, None]) + sums.gather(1, ids))
    bound = bound + 4 * u * (z_a.abs() + lp_a.abs() + z.gather(1, ids).abs())
    return want, bound * valid


def test_candidate_logprobs_are_the_full_softmax_at_each_candidate():
    for dtype in (torch.float32, torch.bfloat16):  # bf16 operands: their products exact in float32
        hidden, weight = _candidate_case(dtype)
        got = _head(hidden, weight).candidate_logprobs(CANDIDATES, temperature=0.7)
        want, bound = _candidate_reference(hidden, weight, 0.7)
        assert got.shape == (12, 5) and got.dtype == torch.float32
        assert_within(got, want, bound, f"candidate logprobs ({dtype})")
        assert (got[11] == 0).all() and (got[6:11, :2] == 0).all()  # ids outside the vocabulary: 0


def candidate_logprobs_on_tp_ranks() -> torch.Tensor:
    """Each of two ranks holds half of the head's rows (25 of 50, vocab_start 0 or 25)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    hidden, weight = _candidate_case(torch.float32)
    rank = dist.get_rank()
    head = LMHeadOutput(
        hidden=hidden,
        weight=weight[25 * rank : 25 * (rank + 1)],
        vocab_start=25 * rank,
        vocab_size=50,
        tp_group=dist.group.WORLD,
        reduce_grad_hidden=True,
        backend="torch",
    )
    return head.candidate_logprobs(CANDIDATES, temperature=0.7)


def test_candidate_logprobs_over_tensor_parallel_ranks():
    """A candidate's row lives on one rank: the others' zeros and its logit summed over the TP group."""
    from tests.actor.dist_utils import run_ranks

    got = run_ranks(2, f"{__name__}:candidate_logprobs_on_tp_ranks")
    want, bound = _candidate_reference(*_candidate_case(torch.float32), 0.7)
    for rank_result in got:
        assert_within(rank_result, want, 2 * bound, "candidate logprobs over TP=2")
