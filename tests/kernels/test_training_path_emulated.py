"""The training path's kernels (issue 16 item 2) on the host emulator: the forward in its storing
variant (split statistics + the chunk's raw fp32 logits in one pass, both mainloops) and
``softmax_grad.cu`` (dz from the stored logits); then ``fused_linear_token_loss`` with
``backend="cuda"`` driving them through ``megarl.kernels._cuda`` exactly as on a GPU, against
float64 autograd over the full logits, on one rank and vocab-parallel over TP=2 (gloo).
"""

from __future__ import annotations

import math
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.kernels import _cuda, linear_loss
from tests.numerics import (
    StatsBounds,
    assert_within,
    gamma,
    matmul_bound,
    softmax_grad_bound,
    softmax_stats_bounds,
    unit_roundoff,
)

from .test_kernels_emulated import (
    MAINLOOPS,
    MERGES_BESIDE_TILES,
    TILE_VOCAB,
    _dz_bound,
    _f32,
    _operands,
    _planted,
    _read,
    _run,
)

# T, H, rows, valid_v, vocab_start, temperature, num_splits, ld: an odd valid count (its last
# column alone in a pair), padding rows, a row stride wider than the valid columns, several
# tiles per split.
STORE = [
    pytest.param(130, 200, 600, 589, 1000, 0.7, 3, 590, id="odd-valid-padded"),
    pytest.param(70, 64, 300, 300, 0, 1.0, 1, 304, id="wide-stride"),
]


@pytest.mark.parametrize("T,H,rows,valid,start,tau,splits,ld", STORE)
@pytest.mark.parametrize("mainloop", MAINLOOPS)
def test_storing_forward_writes_the_raw_logits_and_the_same_partials(
    run_kernels, tmp_path, mainloop, T, H, rows, valid, start, tau, splits, ld
):
    hidden, weight, labels = _operands(T, H, rows, start, valid, seed=T + rows)
    inputs = {"hidden": hidden, "weight": weight, "labels": labels}
    scalars = [T, H, rows, valid, start, repr(_f32(1 / tau)), splits]
    plain, stored = tmp_path / "plain", tmp_path / "stored"
    plain.mkdir(), stored.mkdir()
    _run(run_kernels, plain, ["forward", mainloop], scalars, inputs)
    _run(run_kernels, stored, ["forward", mainloop], [*scalars, ld], inputs)

    logits = _read(stored, "logits", torch.float32, T, ld)
    want = hidden.double() @ weight[:valid].double().T  # raw: before the temperature
    assert_within(logits[:, :valid], want, _raw_logit_bound(hidden, weight[:valid]), "raw logits")
    assert logits[:, valid:].isnan().all(), "written past the valid columns"
    for name, shape in (("part", (3, splits, T)), ("label_logit", (T,))):
        assert torch.equal(_read(plain, name, torch.float32, *shape), _read(stored, name, torch.float32, *shape)), name


def _raw_logit_bound(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The raw logits x = h . w: H products of bf16 operands (exact in fp32) summed in fp32, within
    gamma(H) sum_k |h_k w_k| of exact (tests/numerics.py)."""
    return gamma(hidden.shape[1], torch.float32) * (hidden.double().abs() @ weight.double().abs().T)


def _row_vectors(z: torch.Tensor, labels: torch.Tensor, start: int, valid: int, seed: int) -> dict[str, torch.Tensor]:
    """lse, E[z] of the float64 logits z and upstream gradients (g_lp zero for labels elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    local = labels - start
    hit = (local >= 0) & (local < valid)
    return {
        "lse": torch.logsumexp(z, dim=1).float(),
        "mean_z": (torch.softmax(z, dim=1) * z).sum(dim=1).float(),
        "g_lp": torch.where(hit, torch.randn(len(labels), generator=g), 0.0),
        "g_ent": torch.randn(len(labels), generator=g),
    }


@pytest.mark.parametrize("mainloop", MAINLOOPS)
def test_dz_from_stored_logits_equals_the_recomputing_backward(run_kernels, tmp_path, mainloop):
    """Both kernels apply softmax_grad to the same mainloop's accumulators: bit for bit the same dz."""
    T, H, rows, valid, start, tau, ld = 140, 72, 400, 389, 3, 0.8, 390
    hidden, weight, labels = _operands(T, H, rows, start, valid, seed=5)
    inv_tau = _f32(1 / tau)
    vectors = _row_vectors(hidden.double() @ weight[:valid].double().T * inv_tau, labels, start, valid, seed=6)
    inputs = {"hidden": hidden, "weight": weight, "labels": labels, **vectors}
    _run(run_kernels, tmp_path, ["forward", mainloop], [T, H, rows, valid, start, repr(inv_tau), 2, ld], inputs)
    logits = _read(tmp_path, "logits", torch.float32, T, ld).clone()
    _run(run_kernels, tmp_path, ["softmax_grad"], [T, valid, start, repr(inv_tau), ld, ld], {"logits": logits})
    from_stored = _read(tmp_path, "dz", torch.bfloat16, T, ld).clone()
    assert from_stored[:, valid:].isnan().all(), "dz written past the valid columns"
    _run(run_kernels, tmp_path, ["backward", mainloop], [T, H, rows, valid, start, repr(inv_tau), 0, valid, ld], inputs)
    recomputed = _read(tmp_path, "dz", torch.bfloat16, T, ld)
    assert torch.equal(from_stored[:, :valid], recomputed[:, :valid])


def test_dz_from_stored_logits_matches_float64(run_kernels, tmp_path):
    """Row strides of logits and dz that differ, a one-token chunk and rows past one grid-stride
    pass are covered by the float64 formula directly."""
    T, valid, start, tau, ld_logits, ld_dz = 3, 1001, 10, 1.3, 1004, 1002
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(T, ld_logits, generator=g) * 3
    labels = torch.tensor([start + 7, start + valid - 1, -100])
    inv_tau = _f32(1 / tau)
    z = logits[:, :valid].double() * inv_tau
    vectors = _row_vectors(z, labels, start, valid, seed=10)
    _run(
        run_kernels,
        tmp_path,
        ["softmax_grad"],
        [T, valid, start, repr(inv_tau), ld_logits, ld_dz],
        {"logits": logits, "labels": labels, **vectors},
    )
    dz = _read(tmp_path, "dz", torch.bfloat16, T, ld_dz)
    lse, mean_z, g_lp, g_ent = (vectors[k].double()[:, None] for k in ("lse", "mean_z", "g_lp", "g_ent"))
    p = (z - lse).exp()
    onehot = (torch.arange(valid)[None, :] == (labels - start)[:, None]).double()
    want = inv_tau * (g_lp * (onehot - p) - g_ent * p * (z - mean_z))
    # softmax_grad's fp32 arithmetic from its exact fp32 inputs, rounded to bf16, where z = x * inv_tau is
    # one fp32 rounding of the exact product of the stored logit and the fp32 1/tau
    e_z = unit_roundoff(torch.float32) * z.abs()
    assert_within(dz[:, :valid], want, _dz_bound(z, e_z, lse, mean_z, g_lp, g_ent, onehot, inv_tau), "dz")
    assert dz[:, valid:].isnan().all()


# --------------------------------------------------- the training path through megarl.kernels._cuda


class EmulatedExtension:
    """The entry points of ``megarl._C`` that the logprob and training paths call, run by the
    emulator: same arguments, same outputs (bf16 operands as the bindings take them; here fp32 tensors
    holding bf16 values, as the CPU path hands them over)."""

    TILE_VOCAB, TILE_VOCAB_SM90, DEFAULT_CTA_GROUP = 128, 256, 32  # kDefaultCtaGroup

    def __init__(self, exe: Path, workdir: Path):
        self.exe, self.workdir = exe, workdir

    def _dir(self) -> Path:
        return Path(tempfile.mkdtemp(dir=self.workdir))

    def logprob_forward(
        self, hidden, weight, labels, valid_v, vocab_start, inv_tau, num_splits, wgmma, logits=None, cta_group=32
    ):
        assert torch.equal(hidden, hidden.bfloat16().float()) and torch.equal(weight, weight.bfloat16().float())
        mainloop = "sm90" if wgmma and valid_v > 0 else "sm80"  # bindings.cpp: use_wgmma
        (T, H), rows = hidden.shape, weight.shape[0]
        store = [] if logits is None else [logits.stride(0)]
        work = self._dir()
        _run(
            self.exe,
            work,
            ["forward", mainloop],
            [T, H, rows, valid_v, vocab_start, repr(_f32(inv_tau)), num_splits, *store],
            {"hidden": hidden.bfloat16(), "weight": weight.bfloat16(), "labels": labels},
            cta_group=cta_group,
        )
        if logits is not None:
            logits.copy_(_read(work, "logits", torch.float32, T, logits.stride(0))[:, : logits.shape[1]])
        return [
            _read(work, "part", torch.float32, 3, num_splits, T).clone(),
            _read(work, "label_logit", torch.float32, T).clone(),
        ]

    def logprob_backward_dz(
        self,
        hidden,
        weight,
        labels,
        valid_v,
        vocab_start,
        inv_tau,
        lse,
        mean_z,
        g_lp,
        g_ent,
        col_begin,
        count,
        dz,
        wgmma,
        theta=None,
        cta_group=32,
    ):
        mainloop = "sm90" if wgmma and valid_v > 0 else "sm80"  # bindings.cpp: use_wgmma
        (T, H), rows, work = hidden.shape, weight.shape[0], self._dir()
        _run(
            self.exe,
            work,
            ["backward", mainloop],
            [T, H, rows, valid_v, vocab_start, repr(_f32(inv_tau)), col_begin, count, dz.stride(0), *_truncated(theta)],
            {"hidden": hidden.bfloat16(), "weight": weight.bfloat16(), "labels": labels}
            | {"lse": lse, "mean_z": mean_z, "g_lp": g_lp, "g_ent": g_ent}
            | _theta_input(theta),
            cta_group=cta_group,
        )
        dz[:, :count].copy_(_read(work, "dz", torch.bfloat16, T, dz.stride(0))[:, :count])

    def softmax_grad_stored(
        self, logits, labels, valid_v, vocab_start, inv_tau, lse, mean_z, g_lp, g_ent, dz, theta=None
    ):
        T, work = logits.shape[0], self._dir()
        _run(
            self.exe,
            work,
            ["softmax_grad"],
            [T, valid_v, vocab_start, repr(_f32(inv_tau)), logits.stride(0), dz.stride(0), *_truncated(theta)],
            {"logits": logits, "labels": labels, "lse": lse, "mean_z": mean_z, "g_lp": g_lp, "g_ent": g_ent}
            | _theta_input(theta),
        )
        dz.copy_(_read(work, "dz", torch.bfloat16, T, dz.stride(0))[:, : dz.shape[1]])


def _truncated(theta) -> list[int]:
    """run_kernels' optional last argument: 1 where the launch gets truncation thresholds."""
    return [] if theta is None else [1]


def _theta_input(theta) -> dict[str, torch.Tensor]:
    """The thresholds as the bindings check them (contiguous fp32 [T]), as an emulator input file."""
    if theta is None:
        return {}
    assert theta.dtype == torch.float32 and theta.is_contiguous() and theta.dim() == 1
    return {"theta": theta}


def _use_emulated_kernels(exe: Path, workdir: Path, mainloop: str, patch) -> None:
    """Make ``_cuda`` (the GPU path's Python side) call the emulator: its extension, its mainloop
    choice and the SM count it sizes the splits by. ``patch(obj, name, value)``."""
    patch(_cuda, "load_extension", lambda: EmulatedExtension(exe, workdir))
    patch(_cuda, "use_wgmma", lambda device: mainloop == "sm90")
    patch(_cuda, "_num_sms", lambda index: 2)
    patch(_cuda, "supports", lambda hidden, weight: True)


def _case(T, H, rows, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).bfloat16().float()
    weight = (torch.randn(rows, H, generator=g) * H**-0.5 * 3).bfloat16().float()
    coefs = torch.randn(4, T, generator=g, dtype=torch.float64)
    return hidden, weight, coefs


def _terms(coefs, lp, ent):
    """A nonlinear per-token loss of both inputs (PPO's ratio, an entropy bonus)."""
    a, b, c, d = (x.to(lp.dtype) for x in coefs)
    return a * torch.exp(0.3 * (lp - b)) + c * ent + 0.1 * d * lp * ent


def _reference(hidden, weight, labels, coefs, vocab, tau):
    """float64 autograd through the full logits, with the temperature as the kernels take it (the fp32
    1/tau), and the bound of each result of the kernels' training path against it: [(loss, bound),
    (logprob, bound), (entropy, bound), (grad_hidden, bound), (grad_weight, bound)]."""
    inv_tau = _f32(1 / tau)
    h, w = hidden.double(), weight[:vocab].double()
    x = (h @ w.T).requires_grad_(True)
    logp_all = torch.log_softmax(x * inv_tau, dim=-1)
    hit = (labels >= 0) & (labels < vocab)
    lp = logp_all.gather(1, labels.clamp(0, vocab - 1)[:, None]).squeeze(1) * hit
    ent = -(logp_all.exp() * logp_all).sum(-1)
    loss = _terms(coefs, lp, ent).sum()
    (dz,) = torch.autograd.grad(loss, x)
    d_hidden = dz @ w
    d_weight = torch.zeros(weight.shape, dtype=torch.float64)
    d_weight[:vocab] = dz.T @ h
    bounds = _bounds(h, w, labels, coefs, inv_tau, lp.detach(), ent.detach(), dz)
    bound_w = torch.zeros_like(d_weight)  # padding rows: exactly 0
    bound_w[:vocab] = bounds[4]
    return list(zip((loss.detach(), lp.detach(), ent.detach(), d_hidden, d_weight), (*bounds[:4], bound_w)))


def _forward_merges(vocab: int) -> int:
    """Merges of partial softmax triples on a term's way in the kernels' forward: one per vocab tile of
    its split (at most every 128-row tile of the shard), those inside a tile's CTA (MERGES_BESIDE_TILES),
    the splits' (merge_stats) and the TP group's."""
    return math.ceil(vocab / min(TILE_VOCAB.values())) + MERGES_BESIDE_TILES + 2


def _loss_errors(coefs, lp, ent, stats: StatsBounds) -> tuple[torch.Tensor, ...]:
    """(c0, c1, E_c0, E_c1, E_terms) [T] of _terms computed in fp32 from the fp32 logprob and entropy (within
    ``stats`` of the exact ``lp``, ``ent``) and the coefficients rounded to fp32, with e = exp(0.3 (lp - b)):

      c0 = dterms/dlp = 0.3 a e + 0.1 d ent,  c1 = dterms/dent = c + 0.1 d lp   (autograd in fp32)
      e        relative 0.3 E_lp + u (0.9 |lp - b| + 0.3 |b| + 1)   (b's rounding, lp - b, 0.3's and the
                                                                      product's roundings, exp)
      E_c0     |0.3 a e| (0.3 E_lp + u (0.9 |lp - b| + 0.3 |b| + 6)) + |0.1 d| E_ent + 5u |0.1 d ent|
      E_c1     |0.1 d| E_lp + 2u |c| + 5u |0.1 d lp|
      E_terms  (|0.3 a e| + |0.1 d ent|) E_lp + (|c| + |0.1 d lp|) E_ent
               + u (|a e| (0.9 |lp - b| + 0.3 |b| + 5) + 4 |c ent| + 6 |0.1 d lp ent|)
    (each product, sum and rounded coefficient one u of its magnitude)."""
    u = unit_roundoff(torch.float32)
    a, b, c, d = coefs
    e = torch.exp(0.3 * (lp - b))
    c0, c1 = 0.3 * a * e + 0.1 * d * ent, c + 0.1 * d * lp
    e_lp, e_ent = stats.logprob, stats.entropy
    spread = 0.9 * (lp - b).abs() + 0.3 * b.abs()
    e_c0 = (
        (0.3 * a * e).abs() * (0.3 * e_lp + u * (spread + 6)) + (0.1 * d).abs() * e_ent + 5 * u * (0.1 * d * ent).abs()
    )
    e_c1 = (0.1 * d).abs() * e_lp + 2 * u * c.abs() + 5 * u * (0.1 * d * lp).abs()
    e_terms = (
        ((0.3 * a * e).abs() + (0.1 * d * ent).abs()) * e_lp
        + (c.abs() + (0.1 * d * lp).abs()) * e_ent
        + u * ((a * e).abs() * (spread + 5) + 4 * (c * ent).abs() + 6 * (0.1 * d * lp * ent).abs())
    )
    return c0, c1, e_c0, e_c1, e_terms


def _bounds(h, w, labels, coefs, inv_tau, lp, ent, dz) -> list[torch.Tensor]:
    """Bounds of (loss, logprob, entropy, grad_hidden, grad_weight of the real rows) of
    ``fused_linear_token_loss(backend="cuda")`` against the exact values (``lp``, ``ent``, ``dz`` = dL/dx):

      logits   E_z = gamma(H + 1) |h| . |w| / tau     (H bf16 products summed in fp32, then x fp32 1/tau)
      forward  the kernels' split triples, merged, finalised (softmax_stats_bounds: CUDA's __expf, the merges)
      loss     the per-token derivatives c0, c1 and the terms in fp32 (_loss_errors); their sum over T
               tokens adds gamma(T) sum |addends|
      dz       softmax_grad.cu from the stored logits with the computed lse, E[z], c0, c1 (softmax_grad_bound:
               __expf, rounded to bf16)
      grads    fp32 GEMMs of the bf16 dz: d_hidden sums V terms and the TP group's shares, d_weight T terms."""
    T, H = h.shape
    V = w.shape[0]
    z = h @ w.T * inv_tau
    e_z = gamma(H + 1, torch.float32) * (h.abs() @ w.abs().T) * inv_tau
    stats = softmax_stats_bounds(z, e_z, labels, _forward_merges(V), torch.float32)
    coefs = coefs.double()
    c0, c1, e_c0, e_c1, e_terms = _loss_errors(coefs, lp, ent, stats)
    hit = (labels >= 0) & (labels < V)
    onehot = torch.zeros(T, V, dtype=torch.float64).scatter_(1, labels.clamp(0, V - 1)[:, None], hit[:, None].double())
    lse, mean_z = torch.logsumexp(z, dim=1), (z.softmax(dim=1) * z).sum(dim=1)
    e_dz = softmax_grad_bound(
        z,
        e_z,
        lse,
        mean_z,
        c0 * hit,
        c1,
        onehot,
        inv_tau,
        e_lse=stats.lse,
        e_mean_z=stats.mean_z,
        e_g_lp=e_c0 * hit,
        e_g_ent=e_c1,
        out_dtype=torch.bfloat16,
    )
    a, b, c, d = coefs
    addends = (a * torch.exp(0.3 * (lp - b))).abs() + (c * ent).abs() + (0.1 * d * lp * ent).abs()
    loss = e_terms.sum() + gamma(T, torch.float32) * addends.sum()
    return [
        loss,
        stats.logprob,
        stats.entropy,
        matmul_bound(dz, e_dz, w, extra_roundings=1),  # the sum over the TP group
        matmul_bound(dz.T, e_dz.T, h),
    ]


def _check(got, want, rows: slice | None = None) -> list[float]:
    """``got`` (loss, logprob, entropy, grad_hidden, grad_weight) within the bounds of ``want`` (from
    :func:`_reference`), grad_weight in ``rows`` only (a TP rank's); returns the fraction of each bound used."""
    used = []
    for name, a, (b, bound) in zip(("loss", "logprob", "entropy", "grad_hidden", "grad_weight"), got, want):
        if name == "grad_weight" and rows is not None:
            b, bound = b[rows], bound[rows]
        used.append(assert_within(a, b, bound, name))
    return used


def _fused(hidden, weight, labels, coefs, **kwargs):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss, lp, ent = linear_loss.fused_linear_token_loss(
        h, w, labels, lambda t0, t1, lp, ent: _terms(coefs[:, t0:t1], lp, ent), backend="cuda", **kwargs
    )
    loss.backward()
    return loss.detach(), lp, ent, h.grad, w.grad


@pytest.mark.parametrize("mainloop", MAINLOOPS)
def test_training_path_on_the_kernels_matches_float64_autograd(run_kernels, tmp_path, monkeypatch, mainloop):
    _use_emulated_kernels(run_kernels, tmp_path, mainloop, monkeypatch.setattr)
    T, H, rows, vocab, tau = 150, 48, 300, 291, 0.8  # padding rows; the last chunk of 22 tokens
    hidden, weight, coefs = _case(T, H, rows, seed=1)
    labels = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(2))
    labels[:3] = torch.tensor([-100, vocab - 1, 0])
    got = _fused(hidden, weight, labels, coefs, temperature=tau, vocab_size=vocab, chunk_tokens=64)
    _check(got, _reference(hidden, weight, labels, coefs, vocab, tau))
    assert torch.all(got[4][vocab:] == 0), "padding rows must get zero gradient"


WORLD = 2
TP_CASES = [(150, 291), (100, 99)]  # rows per rank, real vocab: rank 1 padded; then rank 1 all padding


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, port: int, exe: str, workdir: str, mainloop: str) -> None:
    _use_emulated_kernels(Path(exe), Path(workdir), mainloop, setattr)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group([0, 1])
        for rows, vocab in TP_CASES:
            T, H, tau = 90, 40, 1.2
            hidden, weight, coefs = _case(T, H, rows * WORLD, seed=rows)
            labels = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(vocab))
            labels[0], labels[1] = -100, vocab - 1
            want = _reference(hidden, weight, labels, coefs, vocab, tau)
            own = slice(rank * rows, (rank + 1) * rows)
            got = _fused(
                hidden, weight[own], labels, coefs, tp_group=group, temperature=tau, vocab_size=vocab, chunk_tokens=32
            )
            _check(got, want, rows=own)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("mainloop", MAINLOOPS)
def test_training_path_on_the_kernels_over_two_vocab_parallel_ranks(run_kernels, tmp_path, mainloop):
    mp.spawn(_tp_worker, args=(_free_port(), str(run_kernels), str(tmp_path), mainloop), nprocs=WORLD, join=True)


def test_each_derived_bound_rejects_an_error_just_above_it():
    """The raw logits', the stored-logits dz's and the training path's bounds (loss, logprob, entropy and
    both gradients) are not vacuous: the exact values with one element moved 1.01 bounds away fail,
    0.99 bounds pass."""
    T, H, rows, vocab, tau = 40, 48, 100, 91, 0.8
    hidden, weight, coefs = _case(T, H, rows, seed=3)
    labels = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(4))
    labels[0] = -100
    inv_tau = _f32(1 / tau)
    raw = hidden.double() @ weight[:vocab].double().T
    z = raw * inv_tau
    vectors = _row_vectors(z, labels, 0, vocab, seed=5)
    lse, mean_z, g_lp, g_ent = (vectors[k].double()[:, None] for k in ("lse", "mean_z", "g_lp", "g_ent"))
    onehot = (torch.arange(vocab)[None, :] == labels[:, None]).double()
    p = (z - lse).exp()
    dz = inv_tau * (g_lp * (onehot - p) - g_ent * p * (z - mean_z))
    e_z = unit_roundoff(torch.float32) * z.abs()
    names = ("loss", "logprob", "entropy", "grad_hidden", "grad_weight")
    checks = {
        "raw logits": (raw, _raw_logit_bound(hidden, weight[:vocab])),
        "dz": (dz, _dz_bound(z, e_z, lse, mean_z, g_lp, g_ent, onehot, inv_tau)),
        **dict(zip(names, _reference(hidden, weight, labels, coefs, vocab, tau))),
    }
    for what, (want, bound) in checks.items():
        assert bound.min() >= 0 and bound.max() > 0, what
        assert_within(_planted(want, bound, 0.99), want, bound, what)
        with pytest.raises(AssertionError, match=f"{what}: 1 of"):
            assert_within(_planted(want, bound, 1.01), want, bound, what)
