"""Truncation replay on the CUDA kernels, run by the host emulator: the backward kernels of both
mainloops and ``softmax_grad.cu`` take the per-token threshold theta (units of z = logits / T) and
leave the tokens below it out of the softmax, as ``reference.grads_chunked(threshold=...)`` does.

Checked here: dz of the recomputing backward (sm80 and sm90) and of the stored-logits kernel
against float64 with the mask; ``megarl.kernels._cuda.grads`` with the threshold that
``truncation.truncated_stats`` finds (top-p + top-k, min-p) against the torch path on one rank and
over two vocab shards that share the global threshold; ``fused_logprobs_entropy(backend="cuda",
truncation=...)`` running that backward; and that a kernel ignoring the threshold is far outside
the tolerance (the truncated and untruncated gradients differ by a clear margin). The training
path (``fused_linear_token_loss``) on the kernels: the threshold from each chunk's stored logits,
then ``softmax_grad.cu`` with it. Both paths over a real 2-rank gloo group (slow).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.kernels import Truncation, _cuda, fused_logprobs_entropy, linear_loss
from megarl.kernels.reference import VocabShard, finalize_stats, grads_chunked
from megarl.kernels.selfcheck import TOLERANCES
from megarl.kernels.truncation import truncated_stats

from .test_kernels_emulated import MAINLOOPS, _bf16_ulp, _f32, _logits, _operands, _read, _run
from .test_training_path_emulated import EmulatedExtension, _free_port, _use_emulated_kernels

TRUNCATIONS = [
    pytest.param(Truncation(top_p=0.8, top_k=20), id="top_p0.8-top_k20"),
    pytest.param(Truncation(min_p=0.1), id="min_p0.1"),
]


def _kept_rows_thresholds(z: torch.Tensor, k: int) -> torch.Tensor:
    """theta [T] fp32: halfway between each row's k-th and (k+1)-th largest z (k tokens kept), as
    ``truncated_stats`` places it; every third row -inf (that row untruncated)."""
    top = z.topk(k + 1, dim=1).values
    assert (top[:, k - 1] - top[:, k]).min() > 1e-4, "a kept/dropped pair closer than the fp32 logits' error"
    theta = ((top[:, k - 1] + top[:, k]) / 2).float()
    theta[::3] = -math.inf
    return theta


def _truncated_vectors(z: torch.Tensor, theta: torch.Tensor, labels, start, valid, seed) -> dict[str, torch.Tensor]:
    """lse, E[z] of the softmax over {z >= theta} (float64 z), upstream gradients, theta."""
    g = torch.Generator().manual_seed(seed)
    local = labels - start
    hit = (local >= 0) & (local < valid)
    masked = z.masked_fill(z < theta.double()[:, None], -math.inf)
    p = torch.softmax(masked, dim=1)
    return {
        "lse": torch.logsumexp(masked, dim=1).float(),
        "mean_z": torch.where(p > 0, p * z, 0.0).sum(dim=1).float(),
        "g_lp": torch.where(hit, torch.randn(len(labels), generator=g), 0.0),
        "g_ent": torch.randn(len(labels), generator=g),
        "theta": theta,
    }


def _want_dz(z, cols, local, vectors, inv_tau):
    """(dL/dx float64 with p = 0 below theta, the scale of its terms) for the columns ``cols`` of z."""
    lse, mean_z, g_lp, g_ent, theta = (
        vectors[k].double()[:, None] for k in ("lse", "mean_z", "g_lp", "g_ent", "theta")
    )
    p = (z - lse).exp().masked_fill(z < theta, 0.0)
    onehot = (cols[None, :] == local[:, None]).double()
    want = inv_tau * (g_lp * (onehot - p) - g_ent * p * (z - mean_z))
    terms = inv_tau * (g_lp.abs() * (onehot + p) + g_ent.abs() * p * (z - mean_z).abs())
    return want, terms


def _assert_dz(got, want, terms, padding=None):
    """Within one bf16 ulp of the exact value rounded to bf16, plus fp32 rounding of the terms
    (test_kernels_emulated.test_backward_dz's bound)."""
    want_bf16 = want.bfloat16().double()
    tol = _bf16_ulp(want_bf16) + 1e-5 * terms
    bad = ~((got - want_bf16).abs() <= tol)
    if padding is not None:
        bad &= ~padding
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} dz values off, e.g. at {bad.nonzero()[:5].tolist()}: "
        f"got {got[bad][:5].tolist()}, want {want[bad][:5].tolist()}"
    )


@pytest.mark.parametrize("mainloop", MAINLOOPS)
def test_backward_dz_leaves_the_tokens_below_the_threshold_out(run_kernels, tmp_path, mainloop):
    """The recomputing backward with theta: p = 0 below it in both terms, the label's one-hot term
    kept wherever it lies; the same launch without theta gives the full softmax's dz."""
    T, H, rows, valid, start, tau, col_begin, col_count, ld = 130, 200, 600, 589, 1000, 0.7, 130, 300, 310
    hidden, weight, labels = _operands(T, H, rows, start, valid, seed=21)
    inv_tau = _f32(1 / tau)
    z_valid = _logits(hidden, weight, valid, inv_tau)
    theta = _kept_rows_thresholds(z_valid, k=20)
    vectors = _truncated_vectors(z_valid, theta, labels, start, valid, seed=22)
    inputs = {"hidden": hidden, "weight": weight, "labels": labels, **vectors}
    scalars = [T, H, rows, valid, start, repr(inv_tau), col_begin, col_count, ld]
    _run(run_kernels, tmp_path, ["backward", mainloop], [*scalars, 1], inputs)
    dz = _read(tmp_path, "dz", torch.bfloat16, T, ld).clone()
    assert dz[:, col_count:].isnan().all(), "dz written past col_count"
    got = dz[:, :col_count].double()

    cols = torch.arange(col_begin, col_begin + col_count)
    z = hidden.double() @ weight[cols].double().T * inv_tau
    local = labels - start
    want, terms = _want_dz(z, cols, local, vectors, inv_tau)
    padding = (cols >= valid)[None, :].expand_as(want)
    assert (got[padding] == 0).all(), "padding rows must get a zero gradient"
    _assert_dz(got, want, terms, padding)
    dropped = (z < theta.double()[:, None]) & ~padding & (cols[None, :] != local[:, None])
    assert dropped.sum() > 10_000 and (got[dropped] == 0).all()

    # the threshold ignored (the launch without it): p > 0 below theta, far outside the bound
    _run(run_kernels, tmp_path, ["backward", mainloop], scalars, inputs)
    ignored = _read(tmp_path, "dz", torch.bfloat16, T, ld)[:, :col_count].double()
    assert (ignored[dropped] != 0).float().mean() > 0.9
    assert torch.equal(ignored[0::3], got[0::3]), "rows with theta = -inf: the untruncated arithmetic"


def test_dz_from_stored_logits_with_the_threshold(run_kernels, tmp_path):
    """softmax_grad.cu (the training path's dz) with theta: a pair-straddling odd last column,
    a row stride wider than the valid columns, a one-token-kept row (only the max survives)."""
    T, valid, start, tau, ld_logits, ld_dz = 5, 1001, 10, 1.3, 1004, 1002
    g = torch.Generator().manual_seed(23)
    logits = torch.randn(T, ld_logits, generator=g) * 3
    labels = torch.tensor([start + 7, start + valid - 1, -100, start + 3, start])
    inv_tau = _f32(1 / tau)
    z = logits[:, :valid].double() * inv_tau
    theta = _kept_rows_thresholds(z, k=30)
    top = z.topk(2, dim=1).values
    theta[4] = ((top[4, 0] + top[4, 1]) / 2).float()  # one token kept
    vectors = _truncated_vectors(z, theta, labels, start, valid, seed=24)
    _run(
        run_kernels,
        tmp_path,
        ["softmax_grad"],
        [T, valid, start, repr(inv_tau), ld_logits, ld_dz, 1],
        {"logits": logits, "labels": labels, **vectors},
    )
    dz = _read(tmp_path, "dz", torch.bfloat16, T, ld_dz)
    assert dz[:, valid:].isnan().all()
    want, terms = _want_dz(z, torch.arange(valid), labels - start, vectors, inv_tau)
    _assert_dz(dz[:, :valid].double(), want, terms)


# ------------------------------------------- _cuda.grads with the threshold truncated_stats finds

T, H, V, TAU = 60, 48, 300, 0.7
ROWS = 152  # per rank over two vocab shards: rank 1 holds 148 real rows and 4 padding


def _case(seed: int):
    """bf16 hidden [T, H] and weight [2 * ROWS, H] (rows past V zero: padding), labels drawn from
    the model's full softmax (some fall outside the truncated set), a few -100."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    weight = torch.zeros(2 * ROWS, H)
    weight[:V] = torch.randn(V, H, generator=g) * H**-0.5 * 4
    weight = weight.bfloat16()
    z = hidden.double() @ weight[:V].double().T / TAU
    labels = torch.multinomial(z.softmax(dim=1), 1, generator=g).squeeze(1)
    labels[:2] = -100
    return hidden, weight, labels


def _truncated_softmax(hidden, weight, labels, trunc: Truncation):
    """(lse, mean_z, theta) of the global truncated softmax, from truncated_stats over the whole
    vocabulary (the values every TP rank gets; chunks as the torch path's)."""
    shard = VocabShard(start=0, valid=V, vocab_size=V)
    m, s, u, label_logit, theta, _ = truncated_stats(hidden, weight[:V], labels, shard, 1 / TAU, trunc, None, 1, 16, 64)
    _, _, lse, mean_z = finalize_stats(m, s, u, label_logit, (labels >= 0) & (labels < V))
    kept = (hidden.double() @ weight[:V].double().T / TAU >= theta.double()[:, None]).sum(dim=1)
    assert (kept < V).all() and (kept > 1).any(), "the filter must truncate (and not to one token everywhere)"
    return lse, mean_z, theta


def _truncated_backward_inputs(hidden, weight, labels, trunc: Truncation, seed: int):
    """What the autograd backward hands the kernels: (lse, mean_z, g_lp, g_ent, theta)."""
    lse, mean_z, theta = _truncated_softmax(hidden, weight, labels, trunc)
    g = torch.Generator().manual_seed(seed)
    g_lp = torch.where((labels >= 0) & (labels < V), torch.randn(T, generator=g), 0.0)
    return lse, mean_z, g_lp, torch.randn(T, generator=g), theta


def _exact(hidden, weight, labels, lse, mean_z, g_lp, g_ent, theta):
    """The float64 gradients (d_hidden, d_weight of the real rows) of the truncated softmax from
    these per-token vectors, and their bounds: the selfcheck's gradient tolerance, atol + rtol x
    the GEMMs of |dz| (the scale of rounding dz and d_weight to bf16), plus 1e-5 x the GEMMs of
    dz's terms |g_lp| (1[label] + p) + |g_ent| p |z - E[z]| (fp32 rounding where they cancel, as
    test_backward_dz's bound has it: a row that keeps one token has dz = 0 up to that rounding)."""
    atol, rtol = TOLERANCES["gradients"]
    z = hidden.double() @ weight[:V].double().T / TAU
    vectors = {"lse": lse, "mean_z": mean_z, "g_lp": g_lp, "g_ent": g_ent, "theta": theta}
    dz, terms = _want_dz(z, torch.arange(V), labels, vectors, 1 / TAU)
    w, h = weight[:V].double(), hidden.double()
    bound_h = atol + rtol * (dz.abs() @ w.abs()) + 1e-5 * (terms @ w.abs())
    bound_w = atol + rtol * (dz.abs().T @ h.abs()) + 1e-5 * (terms.T @ h.abs())
    return (dz @ w, bound_h), (dz.T @ h, bound_w)


def _ratio(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest |got - want| / bound: <= 1 within the tolerance."""
    return ((got.double() - want.double()).abs() / bound).max().item()


def _assert_close(got: torch.Tensor, torch_path: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The kernels' gradient and the torch path's each within the bound of the float64 one, so
    within twice it of each other."""
    want, bound = exact
    assert _ratio(got, want, bound) <= 1, f"kernels off by {_ratio(got, want, bound):.3g} x the bound"
    assert _ratio(torch_path, want, bound) <= 1, f"torch path off by {_ratio(torch_path, want, bound):.3g}"
    assert _ratio(got, torch_path, 2 * bound) <= 1


def _emulated(run_kernels, tmp_path, monkeypatch, mainloop):
    _use_emulated_kernels(run_kernels, tmp_path, mainloop, monkeypatch.setattr)
    return mainloop


@pytest.mark.parametrize("trunc", TRUNCATIONS)
def test_cuda_grads_with_the_threshold_equal_the_torch_path(run_kernels, tmp_path, monkeypatch, trunc):
    """One rank (sm80), and over two vocab shards (sm90) whose d_hidden shares add up: each shard's
    kernels take the global theta, lse and E[z]. A kernel that ignored theta would be off by a
    wide margin (checked with the same inputs and no threshold)."""
    hidden, weight, labels = _case(seed=31)
    vectors = _truncated_backward_inputs(hidden, weight, labels, trunc, seed=32)
    *stats, theta = vectors
    whole = VocabShard(start=0, valid=V, vocab_size=V)
    want_h, want_w = grads_chunked(hidden, weight[:V], labels, whole, 1 / TAU, *stats, 16, 64, threshold=theta)
    exact_h, exact_w = _exact(hidden, weight, labels, *vectors)

    _emulated(run_kernels, tmp_path, monkeypatch, "sm80")
    got_h, got_w = _cuda.grads(hidden, weight[:V], labels, whole, 1 / TAU, *stats, 128, threshold=theta)
    _assert_close(got_h, want_h, exact_h)
    _assert_close(got_w, want_w, exact_w)

    # the threshold ignored: the full softmax's p against the truncated lse
    ign_h, ign_w = _cuda.grads(hidden, weight[:V], labels, whole, 1 / TAU, *stats, 128)
    assert _ratio(ign_h, *exact_h) > 100 and _ratio(ign_w, *exact_w) > 100
    assert (ign_h - got_h).norm() > 0.1 * got_h.norm()

    # two vocab shards (TP=2 split in-process), the sm90 mainloop
    _emulated(run_kernels, tmp_path, monkeypatch, "sm90")
    d_hidden = torch.zeros(T, H)
    for rank in range(2):
        shard = VocabShard(start=rank * ROWS, valid=min(ROWS, V - rank * ROWS), vocab_size=V)
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        part_h, part_w = _cuda.grads(hidden, weight[rows], labels, shard, 1 / TAU, *stats, 64, threshold=theta)
        d_hidden += part_h
        real = slice(rank * ROWS, rank * ROWS + shard.valid)
        _assert_close(part_w[: shard.valid], want_w[real], (exact_w[0][real], exact_w[1][real]))
        assert not part_w[shard.valid :].any(), "padding rows get no gradient"
    _assert_close(d_hidden, want_h, exact_h)


@pytest.mark.parametrize("trunc", TRUNCATIONS)
def test_fused_logprobs_entropy_runs_the_cuda_backward_with_truncation(run_kernels, tmp_path, monkeypatch, trunc):
    """backend="cuda" with truncation: the forward's truncated_stats (torch), then _cuda.grads with
    its threshold; logprob and entropy as the torch backend's, gradients within the bf16 bound."""
    hidden, weight, labels = _case(seed=41)
    coefs = torch.randn(2, T, generator=torch.Generator().manual_seed(42))

    def run(backend):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        lp, ent = fused_logprobs_entropy(
            h, w, labels, temperature=TAU, vocab_size=V, truncation=trunc, backend=backend, chunk_tokens=16
        )
        (coefs[0] * lp + coefs[1] * ent).sum().backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    want = run("torch")
    _emulated(run_kernels, tmp_path, monkeypatch, "sm80")
    seen = []
    real_grads = _cuda.grads

    def grads(*args, threshold=None, **kwargs):
        seen.append(threshold)
        return real_grads(*args, threshold=threshold, **kwargs)

    monkeypatch.setattr(_cuda, "grads", grads)
    got = run("cuda")
    assert len(seen) == 1 and seen[0] is not None and torch.isfinite(seen[0]).all()
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the same torch forward
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    # dL/dlogprob, dL/dentropy = coefs: the bound of those upstream gradients
    lse, mean_z, theta = _truncated_softmax(hidden, weight, labels, trunc)
    torch.testing.assert_close(seen[0], theta, rtol=1e-6, atol=1e-6)  # other chunk sizes: rounding
    g_lp = torch.where((labels >= 0) & (labels < V), coefs[0], 0.0)
    exact_h, exact_w = _exact(hidden, weight, labels, lse, mean_z, g_lp, coefs[1], theta)
    _assert_close(got[2], want[2], exact_h)
    _assert_close(got[3][:V], want[3][:V], exact_w)
    assert not got[3][V:].any()


@pytest.mark.parametrize("trunc", TRUNCATIONS)
def test_training_path_on_the_kernels_with_truncation(run_kernels, tmp_path, monkeypatch, trunc):
    """fused_linear_token_loss(backend="cuda", truncation=...): the storing forward, the threshold
    from a topk of each chunk's stored raw logits, then softmax_grad.cu with it; against the torch
    training path and the float64 gradient."""
    hidden, weight, labels = (t.float() if t.is_floating_point() else t for t in _case(seed=51))
    coefs = torch.randn(2, T, generator=torch.Generator().manual_seed(52))

    def run(backend):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        loss, lp, ent, outside = linear_loss.fused_linear_token_loss(
            h,
            w,
            labels,
            lambda t0, t1, lp, ent: coefs[0, t0:t1] * lp + coefs[1, t0:t1] * ent,
            temperature=TAU,
            vocab_size=V,
            chunk_tokens=16,
            truncation=trunc,
            return_outside=True,
            backend=backend,
        )
        loss.backward()
        return lp, ent, h.grad, w.grad, outside

    want = run("torch")
    _emulated(run_kernels, tmp_path, monkeypatch, "sm80")
    seen = []
    real = EmulatedExtension.softmax_grad_stored

    def softmax_grad_stored(self, *args, theta=None):
        seen.append(theta)
        return real(self, *args, theta=theta)

    monkeypatch.setattr(EmulatedExtension, "softmax_grad_stored", softmax_grad_stored)
    got = run("cuda")
    assert len(seen) == 4 and all(theta is not None for theta in seen)  # one per 16-token chunk
    assert torch.equal(got[4], want[4])
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    lse, mean_z, theta = _truncated_softmax(hidden.bfloat16(), weight.bfloat16(), labels, trunc)
    torch.testing.assert_close(torch.cat(seen), theta, atol=1e-5, rtol=1e-6)
    g_lp = torch.where((labels >= 0) & (labels < V), coefs[0], 0.0)
    exact_h, exact_w = _exact(hidden, weight, labels, lse, mean_z, g_lp, coefs[1], theta)
    _assert_close(got[2], want[2], exact_h)
    _assert_close(got[3][:V], want[3][:V], exact_w)
    assert not got[3][V:].any()


WORLD = 2


def _tp_worker(rank: int, port: int, exe: str, workdir: str) -> None:
    """Both truncated paths on the emulated kernels (the sm90 mainloop) over
    a real 2-rank gloo group: the candidates gathered over it, each shard's kernels with the global
    threshold; equal to the single-rank torch paths."""
    _use_emulated_kernels(Path(exe), Path(workdir), "sm90", setattr)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group([0, 1])
        own = slice(rank * ROWS, (rank + 1) * ROWS)
        for i, trunc in enumerate(Truncation(**kw) for kw in ({"top_p": 0.8, "top_k": 20}, {"min_p": 0.1})):
            hidden, weight, labels = (t.float() if t.is_floating_point() else t for t in _case(seed=61 + i))
            coefs = torch.randn(2, T, generator=torch.Generator().manual_seed(62 + i))
            lse, mean_z, theta = _truncated_softmax(hidden.bfloat16(), weight.bfloat16(), labels, trunc)
            g_lp = torch.where((labels >= 0) & (labels < V), coefs[0], 0.0)
            exact_h, exact_w = _exact(hidden, weight, labels, lse, mean_z, g_lp, coefs[1], theta)
            exact_w = (exact_w[0][own], exact_w[1][own])
            rows = min(ROWS, V - rank * ROWS)
            for name, fn in (("logprob path", _logprob_path), ("training path", _training_path)):
                want = fn(hidden, weight, labels, coefs, trunc, "torch")
                got = fn(hidden, weight[own], labels, coefs, trunc, "cuda", tp_group=group)
                torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
                _assert_close(got[1], want[1], exact_h)
                _assert_close(got[2][:rows], want[2][own][:rows], (exact_w[0][:rows], exact_w[1][:rows]))
                assert not got[2][rows:].any(), f"{name}: padding rows get no gradient"
    finally:
        dist.destroy_process_group()


def _loss_of(coefs, t0, t1, lp, ent):
    return coefs[0, t0:t1] * lp + coefs[1, t0:t1] * ent


def _logprob_path(hidden, weight, labels, coefs, trunc, backend, **kwargs):
    h, w = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    lp, ent = fused_logprobs_entropy(
        h, w, labels, temperature=TAU, vocab_size=V, truncation=trunc, backend=backend, chunk_tokens=16, **kwargs
    )
    _loss_of(coefs, 0, T, lp, ent).sum().backward()
    return lp.detach(), h.grad.float(), w.grad.float()


def _training_path(hidden, weight, labels, coefs, trunc, backend, **kwargs):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, lp, _ = linear_loss.fused_linear_token_loss(
        h,
        w,
        labels,
        lambda t0, t1, lp, ent: _loss_of(coefs, t0, t1, lp, ent),
        temperature=TAU,
        vocab_size=V,
        chunk_tokens=32,
        truncation=trunc,
        backend=backend,
        **kwargs,
    )
    loss.backward()
    return lp, h.grad, w.grad


@pytest.mark.slow
@pytest.mark.multiproc
def test_both_truncated_paths_on_the_kernels_over_two_vocab_parallel_ranks(run_kernels, tmp_path):
    mp.spawn(_tp_worker, args=(_free_port(), str(run_kernels), str(tmp_path)), nprocs=WORLD, join=True)
