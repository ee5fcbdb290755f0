"""Truncation replay on the CUDA kernels, run by the host emulator: the backward kernels of both
mainloops and ``softmax_grad.cu`` take the per-token threshold theta (units of z = logits / T) and
leave the tokens below it out of the softmax, as ``reference.grads_chunked(threshold=...)`` does.

Checked here: dz of the recomputing backward (sm80 and sm90) and of the stored-logits kernel
against float64 with the mask; ``megarl.kernels._cuda.grads`` with the threshold that
``truncation.truncated_stats`` finds (top-p + top-k, min-p) and the torch path, on one rank and
over two vocab shards that share the global threshold; ``fused_logprobs_entropy(backend="cuda",
truncation=...)`` running that backward; and that a kernel ignoring the threshold is far outside
the bound (the truncated and untruncated gradients differ by a clear margin). The training
path (``fused_linear_token_loss``) on the kernels: the threshold from each chunk's stored logits,
then ``softmax_grad.cu`` with it. Both paths over a real 2-rank gloo group (slow).

Every result is checked against float64 within its error bound (tests/numerics.py): the kernels' dz
within softmax_grad_bound (fp32 arithmetic with CUDA's ``__expf``, rounded to bf16), the gradients within
matmul_bound of the GEMMs that sum it, logprob and entropy within softmax_stats_bounds, the thresholds
within the rounding of the logits they are placed between. The data keep every logit more than its
error away from its threshold, so the fp32 logits keep the same tokens as the exact ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.kernels import Truncation, _cuda, fused_logprobs_entropy, linear_loss
from megarl.kernels.reference import VocabShard, finalize_stats, grads_chunked
from megarl.kernels.truncation import _threshold_from_candidates, truncated_stats
from tests.numerics import (
    StatsBounds,
    assert_within,
    gamma,
    matmul_bound,
    softmax_grad_bound,
    softmax_stats_bounds,
    unit_roundoff,
)

from .test_kernels_emulated import MAINLOOPS, _f32, _logits, _operands, _planted, _read, _run
from .test_training_path_emulated import EmulatedExtension, _free_port, _use_emulated_kernels

TRUNCATIONS = [
    pytest.param(Truncation(top_p=0.8, top_k=20), id="top_p0.8-top_k20"),
    pytest.param(Truncation(min_p=0.1), id="min_p0.1"),
]


def _logit_error(hidden: torch.Tensor, weight: torch.Tensor, inv_tau: float) -> torch.Tensor:
    """E_z [T, rows]: H products of bf16 operands (exact in fp32) summed in fp32, then times the fp32
    1/tau: within gamma(H + 1) sum_k |h_k w_k| / tau of exact (tests/numerics.py)."""
    return gamma(hidden.shape[1] + 1, torch.float32) * (hidden.double().abs() @ weight.double().abs().T) * inv_tau


def _assert_clear_of_thresholds(z: torch.Tensor, e_z: torch.Tensor, theta: torch.Tensor) -> None:
    """No logit within its error bound of its row's (finite) threshold: the computed logits keep the same
    tokens {z >= theta} as the exact ones, whatever their rounding."""
    finite = torch.isfinite(theta)
    close = (z[finite] - theta[finite].double()[:, None]).abs() <= e_z[finite]
    assert not close.any(), f"{int(close.sum())} logits within their fp32 error of the threshold"


def _kept_rows_thresholds(z: torch.Tensor, e_z: torch.Tensor, k: int, choices: int = 5) -> torch.Tensor:
    """theta [T] fp32: halfway between two consecutive largest z of each row, as ``truncated_stats`` places
    it, across the widest of the gaps after the k-th to the (k + choices - 1)-th (k to k + choices - 1
    tokens kept, clear of the logits' error); every third row -inf (that row untruncated)."""
    top = z.topk(k + choices, dim=1).values
    gaps = top[:, k - 1 : k + choices - 1] - top[:, k : k + choices]
    kept = k + gaps.argmax(dim=1)  # tokens kept per row
    rows = torch.arange(len(z))
    theta = ((top[rows, kept - 1] + top[rows, kept]) / 2).float()
    theta[::3] = -math.inf
    _assert_clear_of_thresholds(z, e_z, theta)
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


def _want_dz(z, e_z, cols, local, vectors, inv_tau):
    """(dL/dx float64 with p = 0 below theta, its bound) for the columns ``cols`` of z, from the per-token
    vectors as the kernels get them (exact fp32 inputs): the kernels' fp32 arithmetic from logits within
    ``e_z``, with CUDA's __expf, rounded to bf16 (softmax_grad_bound)."""
    lse, mean_z, g_lp, g_ent, theta = (vectors[k].double() for k in ("lse", "mean_z", "g_lp", "g_ent", "theta"))
    kept = z >= theta[:, None]
    p = (z - lse[:, None]).exp().masked_fill(~kept, 0.0)
    onehot = (cols[None, :] == local[:, None]).double()
    want = inv_tau * (g_lp[:, None] * (onehot - p) - g_ent[:, None] * p * (z - mean_z[:, None]))
    bound = softmax_grad_bound(z, e_z, lse, mean_z, g_lp, g_ent, onehot, inv_tau, kept=kept, out_dtype=torch.bfloat16)
    return want, bound


@pytest.mark.parametrize("mainloop", MAINLOOPS)
def test_backward_dz_leaves_the_tokens_below_the_threshold_out(run_kernels, tmp_path, mainloop):
    """The recomputing backward with theta: p = 0 below it in both terms, the label's one-hot term
    kept wherever it lies; the same launch without theta gives the full softmax's dz."""
    T, H, rows, valid, start, tau, col_begin, col_count, ld = 130, 200, 600, 589, 1000, 0.7, 130, 300, 310
    hidden, weight, labels = _operands(T, H, rows, start, valid, seed=21)
    inv_tau = _f32(1 / tau)
    z_valid = _logits(hidden, weight, valid, inv_tau)
    theta = _kept_rows_thresholds(z_valid, _logit_error(hidden, weight[:valid], inv_tau), k=20)
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
    want, bound = _want_dz(z, _logit_error(hidden, weight[cols], inv_tau), cols, local, vectors, inv_tau)
    padding = (cols >= valid)[None, :].expand_as(want)
    assert (got[padding] == 0).all(), "padding rows must get a zero gradient"
    assert_within(got[~padding], want[~padding], bound[~padding], "dz")
    dropped = (z < theta.double()[:, None]) & ~padding & (cols[None, :] != local[:, None])
    assert dropped.sum() > 10_000 and (got[dropped] == 0).all()

    # the threshold ignored (the launch without it): p > 0 below theta, far outside the bound
    _run(run_kernels, tmp_path, ["backward", mainloop], scalars, inputs)
    ignored = _read(tmp_path, "dz", torch.bfloat16, T, ld)[:, :col_count].double()
    assert (ignored[dropped] != 0).float().mean() > 0.9
    # rows with theta = -inf run the kernels' untruncated arithmetic: the same instructions, the same bits
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
    e_z = unit_roundoff(torch.float32) * z.abs()  # z = x * inv_tau: one fp32 rounding of the exact product
    theta = _kept_rows_thresholds(z, e_z, k=30)
    top = z.topk(2, dim=1).values
    theta[4] = ((top[4, 0] + top[4, 1]) / 2).float()  # one token kept
    _assert_clear_of_thresholds(z, e_z, theta)
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
    want, bound = _want_dz(z, e_z, torch.arange(valid), labels - start, vectors, inv_tau)
    assert_within(dz[:, :valid], want, bound, "dz")


# ------------------------------------------- _cuda.grads with the threshold truncated_stats finds

T, H, V, TAU = 60, 48, 300, 0.7
INV_TAU = _f32(1 / TAU)  # the temperature as every path takes it: z = x * fp32(1/tau)
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
    kept = (_logits(hidden, weight, V, INV_TAU) >= theta.double()[:, None]).sum(dim=1)
    assert (kept < V).all() and (kept > 1).any(), "the filter must truncate (and not to one token everywhere)"
    return lse, mean_z, theta


def _truncated_backward_inputs(hidden, weight, labels, trunc: Truncation, seed: int):
    """What the autograd backward hands the kernels: (lse, mean_z, g_lp, g_ent, theta)."""
    lse, mean_z, theta = _truncated_softmax(hidden, weight, labels, trunc)
    g = torch.Generator().manual_seed(seed)
    g_lp = torch.where((labels >= 0) & (labels < V), torch.randn(T, generator=g), 0.0)
    return lse, mean_z, g_lp, torch.randn(T, generator=g), theta


@dataclass
class _Exact:
    """The float64 truncated softmax's gradient of a case: the logits z [T, V] (z = x * INV_TAU) and their
    fp32 error e_z, the kept tokens, the per-token vectors [T] that dz is formed from, dz = dL/dx [T, V] and
    the gradients of hidden [T, H] and of the real weight rows [V, H]; the operands in float64."""

    z: torch.Tensor
    e_z: torch.Tensor
    kept: torch.Tensor
    lse: torch.Tensor
    mean_z: torch.Tensor
    g_lp: torch.Tensor
    g_ent: torch.Tensor
    onehot: torch.Tensor
    dz: torch.Tensor
    d_hidden: torch.Tensor
    d_weight: torch.Tensor
    hidden: torch.Tensor
    weight: torch.Tensor


def _exact(hidden, weight, labels, lse, mean_z, g_lp, g_ent, theta) -> _Exact:
    """The float64 gradients of the truncated softmax {z >= theta} from these per-token vectors (the fp32
    ones a backward is handed, taken as exact, or the exact ones), g_lp already 0 for ignored labels."""
    z = _logits(hidden, weight, V, INV_TAU)
    e_z = _logit_error(hidden, weight[:V], INV_TAU)
    _assert_clear_of_thresholds(z, e_z, theta)
    kept = z >= theta.double()[:, None]
    lse, mean_z, g_lp, g_ent = (x.double() for x in (lse, mean_z, g_lp, g_ent))
    hit = (labels >= 0) & (labels < V)
    onehot = torch.zeros(T, V, dtype=torch.float64).scatter_(1, labels.clamp(0, V - 1)[:, None], hit[:, None].double())
    p = torch.where(kept, (z - lse[:, None]).exp(), 0.0)
    dz = INV_TAU * (g_lp[:, None] * (onehot - p) - g_ent[:, None] * p * (z - mean_z[:, None]))
    h, w = hidden.double(), weight[:V].double()
    return _Exact(z, e_z, kept, lse, mean_z, g_lp, g_ent, onehot, dz, dz @ w, dz.T @ h, h, w)


def _exact_threshold(z: torch.Tensor, labels: torch.Tensor, trunc: Truncation) -> torch.Tensor:
    """theta [T] of the exact logits z [T, V], placed as truncated_stats places it from fp32 ones (the
    filters' threshold over all V candidates, lowered to a label below it, then halfway down to the
    largest dropped logit), in float64."""
    rows, vocab = z.shape
    top = torch.cat([z.sort(dim=1, descending=True).values, z.new_full((rows, 1), -math.inf)], dim=1)
    m = z.amax(dim=1)
    s = (z - m[:, None]).exp().sum(dim=1)
    hit = (labels >= 0) & (labels < vocab)
    lab = torch.where(hit, z.gather(1, labels.clamp(0, vocab - 1)[:, None]).squeeze(1), 0.0)
    theta, covered, _ = _threshold_from_candidates(top, m, s, lab, hit, trunc, vocab, vocab)
    assert covered.all()
    return theta


def _threshold_bound(theta: torch.Tensor, z: torch.Tensor, e_z: torch.Tensor, trunc: Truncation) -> torch.Tensor:
    """How far an fp32 threshold may lie from the exact ``theta`` [T] (0 where it is -inf). truncated_stats
    places it at fl((a + d) / 2): d the largest dropped logit, a the smallest kept one, a label's logit or
    the min-p line fl(m + fl(log min_p)) (m the largest logit). With computed logits within
    E = max_j E_z of exact (the same tokens kept), the min-p line within E + u (|log min_p| + |a|):

      E_theta = (E_a + E_d) / 2 + u |theta| = E + u (|a| + |log min_p|) / 2 + u |theta|   (|log min_p|: min-p)"""
    u = unit_roundoff(torch.float32)
    finite = torch.isfinite(theta)
    d = z.masked_fill(z >= theta[:, None], -math.inf).amax(dim=1)
    a = torch.where(finite, 2 * theta - d, 0.0)
    log_p = abs(math.log(trunc.min_p)) if trunc.min_p > 0 else 0.0
    bound = e_z.amax(dim=1) + u * (a.abs() + log_p) / 2 + u * theta.abs()
    return torch.where(finite, bound, 0.0)


def _assert_threshold(got: torch.Tensor, ex: _Exact, theta: torch.Tensor, trunc: Truncation, what: str) -> float:
    """A path's fp32 thresholds [T]: -inf where the exact one is (nothing dropped), elsewhere within
    _threshold_bound of it, and keeping the exact kept tokens with the logits' error to spare."""
    finite = torch.isfinite(theta)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: other rows untruncated"
    _assert_clear_of_thresholds(ex.z, ex.e_z, got)
    assert torch.equal(ex.z >= got.double()[:, None], ex.kept), f"{what}: other tokens kept"
    return assert_within(got[finite], theta[finite], _threshold_bound(theta, ex.z, ex.e_z, trunc)[finite], what)


def _reference(hidden, weight, labels, coefs, trunc: Truncation):
    """The exact truncated softmax of the loss coefs[0] . logprob + coefs[1] . entropy: (its _Exact, the bounds
    of the fp32 forward's statistics, logprob [T], entropy [T], theta [T]). The forward's statistics
    (truncated_stats, truncated_stats_of_logits) are the largest computed logit and sums over the kept
    candidates, no partial triples merged: softmax_stats_bounds with no merges."""
    z = _logits(hidden, weight, V, INV_TAU)
    theta = _exact_threshold(z, labels, trunc)
    kept = z >= theta[:, None]
    zk = z.masked_fill(~kept, -math.inf)
    lse = torch.logsumexp(zk, dim=1)
    mean_z = torch.where(kept, zk.softmax(dim=1) * z, 0.0).sum(dim=1)
    hit = (labels >= 0) & (labels < V)
    logprob = torch.where(hit, z.gather(1, labels.clamp(0, V - 1)[:, None]).squeeze(1) - lse, 0.0)
    g_lp = torch.where(hit, coefs[0].double(), 0.0)  # dL/dlogprob: the coefficient, exact in fp32
    ex = _exact(hidden, weight, labels, lse, mean_z, g_lp, coefs[1], theta)
    stats = softmax_stats_bounds(z, ex.e_z, labels, 0, torch.float32, kept)
    return ex, stats, logprob, lse - mean_z, theta


# bf16 roundings on a gradient term's way on a CPU (matmul_bound's low_roundings), (d_hidden, d_weight):
LOW_ROUNDINGS = {
    # _cuda.grads: torch's bf16 matmul on a CPU returns bf16 (d_hidden per vocab chunk; d_weight)
    "kernels": (1, 1),
    # reference.grads_chunked: fp32 GEMMs, d_weight stored in the weight's dtype (bf16)
    "torch": (0, 1),
    # fused_logprobs_entropy with bf16 parameters: the above, then d_hidden cast to hidden's bf16
    "logprob path kernels": (2, 1),
    "logprob path torch": (1, 1),
    # fused_linear_token_loss on fp32 operands: fp32 GEMMs of the dz
    "training path kernels": (0, 0),
    "training path torch": (0, 0),
}


def _gradient_bounds(ex: _Exact, path: str, stats: StatsBounds | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds of (d_hidden, d_weight) computed on ``path`` against ``ex``'s: its dz from logits within E_z
    and (with ``stats``) an lse and E[z] within their bounds, else ``ex``'s own (exact fp32 inputs), in the
    kernels' arithmetic (CUDA's __expf, rounded to bf16) or torch's (fp32); then the GEMMs that sum it:
    V terms and the TP group's shares for d_hidden, T terms for d_weight, with the path's bf16 roundings."""
    kernels = path.endswith("kernels")
    e_dz = softmax_grad_bound(
        ex.z,
        ex.e_z,
        ex.lse,
        ex.mean_z,
        ex.g_lp,
        ex.g_ent,
        ex.onehot,
        INV_TAU,
        e_lse=0.0 if stats is None else stats.lse,
        e_mean_z=0.0 if stats is None else stats.mean_z,
        kept=ex.kept,
        fast_exp=kernels,
        out_dtype=torch.bfloat16 if kernels else torch.float32,
    )
    low_h, low_w = LOW_ROUNDINGS[path]
    return (
        matmul_bound(ex.dz, e_dz, ex.weight, extra_roundings=1, low_roundings=low_h),
        matmul_bound(ex.dz.T, e_dz.T, ex.hidden, low_roundings=low_w),
    )


def _ratio(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest |got - want| / bound: <= 1 within the bound."""
    return ((got.double() - want.double()).abs() / bound).max().item()


def _emulated(run_kernels, tmp_path, monkeypatch, mainloop):
    _use_emulated_kernels(run_kernels, tmp_path, mainloop, monkeypatch.setattr)
    return mainloop


@pytest.mark.parametrize("trunc", TRUNCATIONS)
def test_cuda_grads_with_the_threshold_equal_the_torch_path(run_kernels, tmp_path, monkeypatch, trunc):
    """One rank (sm80), and over two vocab shards (sm90) whose d_hidden shares add up: each shard's
    kernels take the global theta, lse and E[z]. Both backwards, given the same fp32 vectors, within
    their bounds of the float64 gradient from those vectors. A kernel that ignored theta would be off by
    a wide margin (checked with the same inputs and no threshold)."""
    hidden, weight, labels = _case(seed=31)
    vectors = _truncated_backward_inputs(hidden, weight, labels, trunc, seed=32)
    *stats, theta = vectors
    whole = VocabShard(start=0, valid=V, vocab_size=V)
    ex = _exact(hidden, weight, labels, *vectors)
    kernel_h, kernel_w = _gradient_bounds(ex, "kernels")
    torch_h, torch_w = _gradient_bounds(ex, "torch")
    want_h, want_w = grads_chunked(hidden, weight[:V], labels, whole, 1 / TAU, *stats, 16, 64, threshold=theta)
    assert_within(want_h, ex.d_hidden, torch_h, "torch path d_hidden")
    assert_within(want_w, ex.d_weight, torch_w, "torch path d_weight")

    _emulated(run_kernels, tmp_path, monkeypatch, "sm80")
    got_h, got_w = _cuda.grads(hidden, weight[:V], labels, whole, 1 / TAU, *stats, 128, threshold=theta)
    assert_within(got_h, ex.d_hidden, kernel_h, "kernels d_hidden")
    assert_within(got_w, ex.d_weight, kernel_w, "kernels d_weight")

    # the threshold ignored: the full softmax's p against the truncated lse
    ign_h, ign_w = _cuda.grads(hidden, weight[:V], labels, whole, 1 / TAU, *stats, 128)
    assert _ratio(ign_h, ex.d_hidden, kernel_h) > 100 and _ratio(ign_w, ex.d_weight, kernel_w) > 100
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
        assert_within(part_w[: shard.valid], ex.d_weight[real], kernel_w[real], f"rank {rank} d_weight")
        assert not part_w[shard.valid :].any(), "padding rows get no gradient"
    assert_within(d_hidden, ex.d_hidden, kernel_h, "two shards' d_hidden")


@pytest.mark.parametrize("trunc", TRUNCATIONS)
def test_fused_logprobs_entropy_runs_the_cuda_backward_with_truncation(run_kernels, tmp_path, monkeypatch, trunc):
    """backend="cuda" with truncation: the forward's truncated_stats (torch), then _cuda.grads with
    its threshold; logprob and entropy the torch backend's, each path's gradients within its bound of
    the float64 ones."""
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
    # both backends run the same torch forward on the same operands: the same bits
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ex, stats, logprob, entropy, theta = _reference(hidden, weight, labels, coefs, trunc)
    assert_within(want[0], logprob, stats.logprob, "logprob")
    assert_within(want[1], entropy, stats.entropy, "entropy")
    # the forward's thresholds (its chunks) and truncated_stats' with other chunks
    _assert_threshold(seen[0], ex, theta, trunc, "the forward's threshold")
    _assert_threshold(_truncated_softmax(hidden, weight, labels, trunc)[2], ex, theta, trunc, "truncated_stats")
    for path, result in (("logprob path kernels", got), ("logprob path torch", want)):
        bound_h, bound_w = _gradient_bounds(ex, path, stats)
        assert_within(result[2], ex.d_hidden, bound_h, f"{path}: d_hidden")
        assert_within(result[3][:V], ex.d_weight, bound_w, f"{path}: d_weight")
    assert not got[3][V:].any()


@pytest.mark.parametrize("trunc", TRUNCATIONS)
def test_training_path_on_the_kernels_with_truncation(run_kernels, tmp_path, monkeypatch, trunc):
    """fused_linear_token_loss(backend="cuda", truncation=...): the storing forward, the threshold
    from a topk of each chunk's stored raw logits, then softmax_grad.cu with it; it and the torch
    training path against the float64 truncated softmax."""
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
    ex, stats, logprob, entropy, theta = _reference(hidden, weight, labels, coefs, trunc)
    for path, result in (("training path kernels", got), ("training path torch", want)):
        assert_within(result[0], logprob, stats.logprob, f"{path}: logprob")
        assert_within(result[1], entropy, stats.entropy, f"{path}: entropy")
        bound_h, bound_w = _gradient_bounds(ex, path, stats)
        assert_within(result[2], ex.d_hidden, bound_h, f"{path}: d_hidden")
        assert_within(result[3][:V], ex.d_weight, bound_w, f"{path}: d_weight")
    assert not got[3][V:].any()
    # the thresholds from the kernels' stored logits, and truncated_stats' (torch) from its own
    _assert_threshold(torch.cat(seen), ex, theta, trunc, "the stored logits' threshold")
    bf16 = (hidden.bfloat16(), weight.bfloat16())
    _assert_threshold(_truncated_softmax(*bf16, labels, trunc)[2], ex, theta, trunc, "truncated_stats")


WORLD = 2


def _tp_worker(rank: int, port: int, exe: str, workdir: str) -> None:
    """Both truncated paths on the emulated kernels (the sm90 mainloop) over a real 2-rank gloo group
    (the candidates gathered over it, each shard's kernels with the global threshold) and the single-rank
    torch paths, each within its bounds of the float64 truncated softmax."""
    _use_emulated_kernels(Path(exe), Path(workdir), "sm90", setattr)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group([0, 1])
        own = slice(rank * ROWS, (rank + 1) * ROWS)
        for i, trunc in enumerate(Truncation(**kw) for kw in ({"top_p": 0.8, "top_k": 20}, {"min_p": 0.1})):
            hidden, weight, labels = (t.float() if t.is_floating_point() else t for t in _case(seed=61 + i))
            coefs = torch.randn(2, T, generator=torch.Generator().manual_seed(62 + i))
            ex, stats, logprob, _, _ = _reference(hidden, weight, labels, coefs, trunc)
            rows = min(ROWS, V - rank * ROWS)
            real = slice(rank * ROWS, rank * ROWS + rows)
            for name, fn in (("logprob path", _logprob_path), ("training path", _training_path)):
                want = fn(hidden, weight, labels, coefs, trunc, "torch")
                got = fn(hidden, weight[own], labels, coefs, trunc, "cuda", tp_group=group)
                for path, result, grad_w in ((f"{name} kernels", got, got[2]), (f"{name} torch", want, want[2][own])):
                    assert_within(result[0], logprob, stats.logprob, f"{path}: logprob")
                    bound_h, bound_w = _gradient_bounds(ex, path, stats)
                    assert_within(result[1], ex.d_hidden, bound_h, f"{path}: d_hidden")
                    assert_within(grad_w[:rows], ex.d_weight[real], bound_w[real], f"{path}: d_weight")
                    assert not grad_w[rows:].any(), f"{path}: padding rows get no gradient"
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


@pytest.mark.parametrize("trunc", TRUNCATIONS)
def test_each_derived_bound_rejects_an_error_just_above_it(trunc):
    """The truncated dz's, the gradients' (kernels and torch path), the truncated logprob's and entropy's
    and the thresholds' bounds are not vacuous: the exact values with one element moved 1.01 bounds away
    fail, 0.99 bounds pass."""
    hidden, weight, labels = _case(seed=71)
    coefs = torch.randn(2, T, generator=torch.Generator().manual_seed(72))
    ex, stats, logprob, entropy, theta = _reference(hidden, weight, labels, coefs, trunc)
    finite = torch.isfinite(theta)
    vectors = {"lse": ex.lse, "mean_z": ex.mean_z, "g_lp": ex.g_lp, "g_ent": ex.g_ent, "theta": theta}
    dz, dz_bound = _want_dz(ex.z, ex.e_z, torch.arange(V), labels, vectors, INV_TAU)
    checks = {
        "dz": (dz, dz_bound),
        "logprob": (logprob, stats.logprob),
        "entropy": (entropy, stats.entropy),
        "threshold": (theta[finite], _threshold_bound(theta, ex.z, ex.e_z, trunc)[finite]),
    }
    for path in ("kernels", "logprob path torch", "training path kernels"):
        bound_h, bound_w = _gradient_bounds(ex, path, stats)
        checks[f"{path} d_hidden"] = (ex.d_hidden, bound_h)
        checks[f"{path} d_weight"] = (ex.d_weight, bound_w)
    for what, (want, bound) in checks.items():
        assert bound.min() >= 0 and bound.max() > 0, what
        assert_within(_planted(want, bound, 0.99), want, bound, what)
        with pytest.raises(AssertionError, match=f"{what}: 1 of"):
            assert_within(_planted(want, bound, 1.01), want, bound, what)
