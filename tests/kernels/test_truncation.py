"""Truncation replay (``megarl.kernels.truncation``): logprob, entropy and gradients of the chunked,
vocab-parallel path under top-k / top-p / min-p equal a plain full-softmax-then-mask reference
written after vLLM 0.32's sampler (min-p, then its ``apply_top_k_top_p_pytorch``), on one rank
and over a real 2-rank gloo group."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.kernels import Truncation, fused_logprobs_entropy
from megarl.kernels.linear_loss import fused_linear_token_loss
from tests.numerics import assert_within, softmax_head_bounds

OUTPUTS = ("logprob", "entropy", "d_hidden", "d_weight")

V, H, T = 300, 16, 23
CASES = [
    Truncation(top_p=0.8),
    Truncation(top_k=20),
    Truncation(min_p=0.3),
    Truncation(top_k=20, top_p=0.8),
    Truncation(top_k=50, top_p=0.9, min_p=0.05),
    Truncation(top_p=0.95, candidates=4),  # a flat distribution: the candidate scan grows 4 -> 16 -> 64 -> 256
    Truncation(min_p=0.5, candidates=4),
    Truncation(top_k=7, top_p=0.5, candidates=2),
]
TEMPERATURES = [1.0, 0.7]


def vllm_rule_logits(z: torch.Tensor, trunc: Truncation) -> torch.Tensor:
    """z [T,V] (already / temperature) with the tokens vLLM 0.32 drops set to -inf: its min-p
    processor, then its ``apply_top_k_top_p_pytorch`` (sort ascending, k-th value, cumsum <= 1 - p)."""
    z = z.clone()
    if trunc.min_p > 0:
        probs = z.softmax(dim=-1)
        z.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * trunc.min_p, float("-inf"))
    logits_sort, logits_idx = z.sort(dim=-1, descending=False)
    if trunc.top_k > 0:
        kth = logits_sort.gather(1, torch.full((z.shape[0], 1), z.shape[1] - trunc.top_k))
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    if trunc.top_p < 1:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = cum <= 1 - trunc.top_p
        mask[:, -1] = False
        logits_sort.masked_fill_(mask, float("-inf"))
    return z.scatter(-1, logits_idx, logits_sort)


def reference(hidden, weight, labels, temperature: float, trunc: Truncation):
    """(logprob, entropy) of the truncated softmax from the full [T, V] logits; differentiable."""
    z = (hidden.double() @ weight.double().T) / temperature
    kept = torch.isfinite(vllm_rule_logits(z.detach(), trunc))  # the mask is a constant
    logp = torch.log_softmax(z.masked_fill(~kept, float("-inf")), dim=-1).masked_fill(~kept, 0.0)
    entropy = -torch.where(kept, logp.exp() * logp, 0.0).sum(dim=-1)
    return logp.gather(1, labels[:, None]).squeeze(1), entropy, kept


def _inputs(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5 * scale
    coefs = torch.randn(2, T, generator=g)
    return hidden, weight, coefs


def _sampled_labels(hidden, weight, temperature, trunc, seed):
    """Labels drawn from the truncated distribution (what a server returns)."""
    z = (hidden.double() @ weight.double().T) / temperature
    probs = vllm_rule_logits(z, trunc).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).squeeze(1)


def _ours(hidden, weight, labels, coefs, temperature, trunc, **kwargs):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    logp, ent, outside = fused_logprobs_entropy(
        hidden,
        weight,
        labels,
        temperature=temperature,
        chunk_tokens=5,
        chunk_vocab=64,
        truncation=trunc,
        return_outside=True,
        backend="torch",
        **kwargs,
    )
    (coefs[0] * logp + coefs[1] * ent).sum().backward()
    return logp.detach(), ent.detach(), hidden.grad, weight.grad, outside


def _want(hidden, weight, labels, coefs, temperature, trunc):
    hidden = hidden.double().requires_grad_(True)
    weight = weight.double().requires_grad_(True)
    logp, ent, kept = reference(hidden, weight, labels, temperature, trunc)
    (coefs[0].double() * logp + coefs[1].double() * ent).sum().backward()
    return logp.detach(), ent.detach(), hidden.grad, weight.grad, kept


def _bounds(hidden, weight, labels, coefs, temperature, kept):
    """The float32 error bounds of the four outputs (``tests/numerics.py``), in OUTPUTS order."""
    b = softmax_head_bounds(hidden, weight, labels, coefs, temperature, torch.float32, kept)
    return [getattr(b, name) for name in OUTPUTS]


def _check(got, want, bounds, factor: float = 1.0) -> None:
    """got within ``factor`` bounds of want: 1 against the exact values, 2 between two float32
    computations (each within one bound of the exact value)."""
    for name, a, b, bound in zip(OUTPUTS, got, want, bounds):
        assert_within(a, b, factor * bound, name)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("trunc", CASES, ids=repr)
def test_truncated_logprobs_match_full_softmax_then_mask(trunc, temperature):
    hidden, weight, coefs = _inputs(seed=3, scale=2.0 if trunc.candidates > 4 else 0.3)
    labels = _sampled_labels(hidden, weight, temperature, trunc, seed=4)
    got = _ours(hidden, weight, labels, coefs, temperature, trunc)
    want = _want(hidden, weight, labels, coefs, temperature, trunc)
    assert not got[4].any()  # every sampled label lies in the kept set
    kept = want[4].sum(dim=1)
    assert (kept < V).all() and (kept > 1).any()  # the filter truncates, and not to one token everywhere
    _check(got, want, _bounds(hidden, weight, labels, coefs, temperature, want[4]))


@pytest.mark.parametrize("trunc", [CASES[3], Truncation()], ids=["truncated", "full-softmax"])
def test_each_derived_bound_rejects_an_error_just_above_it(trunc):
    """The bounds are not vacuous: the exact outputs with one element moved 1.01 bounds away fail,
    each output's bound on its own."""
    temperature = 0.7
    hidden, weight, coefs = _inputs(seed=3, scale=0.3)
    labels = _sampled_labels(hidden, weight, temperature, trunc, seed=4)
    want = _want(hidden, weight, labels, coefs, temperature, trunc)
    bounds = _bounds(hidden, weight, labels, coefs, temperature, want[4])
    for i, name in enumerate(OUTPUTS):
        planted = list(want[:4])
        planted[i] = planted[i].clone()
        planted[i].view(-1)[1] += 1.01 * bounds[i].view(-1)[1]
        with pytest.raises(AssertionError, match=f"{name}: 1 of"):
            _check(planted, want, bounds)
        planted[i].view(-1)[1] -= 0.02 * bounds[i].view(-1)[1]  # 0.99 of the bound: within
        _check(planted, want, bounds)


def _training_path(hidden, weight, labels, coefs, temperature, trunc, **kwargs):
    """fused_linear_token_loss (gradients made in the forward) with the loss _ours backpropagates."""
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    loss, logp, ent, outside = fused_linear_token_loss(
        hidden,
        weight,
        labels,
        lambda t0, t1, lp, en: coefs[0, t0:t1] * lp + coefs[1, t0:t1] * en,
        temperature=temperature,
        chunk_tokens=5,
        truncation=trunc,
        return_outside=True,
        backend="torch",
        **kwargs,
    )
    loss.backward()
    return logp, ent, hidden.grad, weight.grad, outside


@pytest.mark.parametrize("trunc", CASES, ids=repr)
def test_training_path_with_truncation_matches_the_logprob_path(trunc):
    """The threshold from a topk of each chunk's stored logits (candidates grown where they do not
    cover the kept set) gives the logprob path's logprob, entropy and gradients; a label below its
    threshold is counted the same way."""
    hidden, weight, coefs = _inputs(seed=3, scale=2.0 if trunc.candidates > 4 else 0.3)
    labels = _sampled_labels(hidden, weight, 0.7, trunc, seed=4)
    labels[0] = (hidden[0] @ weight.T).argmin()  # below every threshold: outside, theta lowered
    got = _training_path(hidden, weight, labels, coefs, 0.7, trunc)
    want = _ours(hidden, weight, labels, coefs, 0.7, trunc)
    assert got[4][0] and torch.equal(got[4], want[4])
    _check(got, want, _bounds(hidden, weight, labels, coefs, 0.7, _kept_with_labels(hidden, weight, labels, trunc)), 2)


def _kept_with_labels(hidden, weight, labels, trunc, temperature: float = 0.7):
    """The kept set after replay: a label below its row's threshold lowers the threshold to it."""
    z = (hidden.double() @ weight.double().T) / temperature
    kept = torch.isfinite(vllm_rule_logits(z, trunc))
    return kept | (z >= z.gather(1, labels[:, None]))


def test_truncation_changes_the_logprob_and_off_means_full_softmax():
    hidden, weight, coefs = _inputs(seed=5, scale=2.0)
    trunc = Truncation(top_p=0.8, top_k=20)
    labels = _sampled_labels(hidden, weight, 1.0, trunc, seed=6)
    full = fused_logprobs_entropy(hidden, weight, labels, backend="torch")[0]
    off = fused_logprobs_entropy(hidden, weight, labels, backend="torch", truncation=Truncation())[0]
    replay = fused_logprobs_entropy(hidden, weight, labels, backend="torch", truncation=trunc)[0]
    torch.testing.assert_close(off, full)
    assert (replay - full).abs().mean() > 0.1  # the bias replay removes
    # renormalising over fewer tokens raises every kept logprob: exactly, replay >= full; each float32
    # result is within its bound of its exact value, so their difference is at least minus both bounds
    kept = reference(hidden, weight, labels, 1.0, trunc)[2]
    slack = _bounds(hidden, weight, labels, coefs, 1.0, kept)[0] + _bounds(hidden, weight, labels, coefs, 1.0, None)[0]
    assert (replay - full >= -slack).all()


def test_label_outside_the_kept_set_is_counted_and_finite():
    hidden, weight, coefs = _inputs(seed=7, scale=2.0)
    trunc = Truncation(top_k=3)
    z = hidden @ weight.T
    labels = z.argsort(dim=1)[:, 0]  # the least likely token: never kept by top-3
    logp, ent, outside = fused_logprobs_entropy(
        hidden, weight, labels, backend="torch", truncation=trunc, return_outside=True, chunk_vocab=64
    )
    assert outside.all() and torch.isfinite(logp).all() and torch.isfinite(ent).all()
    # its threshold lowered to it keeps every token (past the 256 candidates of the first scan): the
    # replay and the full softmax are each within the float32 bounds of the full softmax's exact values
    full = fused_logprobs_entropy(hidden, weight, labels, backend="torch")
    want = _want(hidden, weight, labels, coefs, 1.0, Truncation())
    assert want[4].all()
    bounds = _bounds(hidden, weight, labels, coefs, 1.0, want[4])
    for got in ((logp, ent), full):
        _check(got, want[:2], bounds[:2])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        rows = 152  # rank 1: 148 real rows + 4 padding
        for i, trunc in enumerate(CASES[4::3]):  # all three filters; top-k + top-p with growing scans
            hidden, weight, coefs = _inputs(seed=10 + i, scale=2.0 if trunc.candidates > 4 else 0.3)
            labels = _sampled_labels(hidden, weight, 0.7, trunc, seed=11 + i)
            want = _want(hidden, weight, labels, coefs, 0.7, trunc)
            padded = torch.cat([weight, torch.zeros(2 * rows - V, H)])
            shard = padded[rank * rows : (rank + 1) * rows]
            got = _ours(hidden, shard, labels, coefs, 0.7, trunc, tp_group=group, vocab_size=V)
            bounds = _bounds(hidden, weight, labels, coefs, 0.7, want[4])
            mine = slice(rank * rows, min((rank + 1) * rows, V))  # this rank's real rows of d_weight
            _check(
                [*got[:3], got[3][: mine.stop - mine.start]], [*want[:3], want[3][mine]], [*bounds[:3], bounds[3][mine]]
            )
            assert not got[3][mine.stop - mine.start :].any()  # padding rows: no gradient
            # the training path: candidates of each chunk's stored logits, gathered over the group
            trained = _training_path(hidden, shard, labels, coefs, 0.7, trunc, tp_group=group, vocab_size=V)
            assert torch.equal(trained[4], got[4])
            n = mine.stop - mine.start
            _check([*trained[:3], trained[3][:n]], [*got[:3], got[3][:n]], [*bounds[:3], bounds[3][mine]], 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_two_rank_vocab_parallel_truncation_matches_reference():
    mp.spawn(_tp_worker, args=(_free_port(),), nprocs=2, join=True)


def test_never_materialises_full_logits():
    from tests.kernels.test_fused_logprob_reference import _MaxNumel

    tokens, vocab, ct, cv, cand = 32, 1024, 16, 128, 8
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(tokens, 4, generator=gen).requires_grad_(True)
    weight = (torch.randn(vocab, 4, generator=gen) * 0.2).requires_grad_(True)  # flat: nuclei of hundreds
    trunc = Truncation(top_p=0.5, candidates=cand)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    with _MaxNumel() as probe:
        logp, ent = fused_logprobs_entropy(
            hidden, weight, labels, chunk_tokens=ct, chunk_vocab=cv, truncation=trunc, backend="torch"
        )
        (logp + ent).sum().backward()
    # chunks (with their running candidates), the parameters' gradients, and the candidates of the
    # positions whose nucleus grew the scan: never [T, V]
    # the parameters' gradients, a chunk beside its rows' candidates, or one row's grown candidates: never [T, V]
    assert probe.max_numel <= max(vocab * 4, 2 * ct * cv, 4 * vocab + 1 + cv) < tokens * vocab
