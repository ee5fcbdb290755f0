"""The training path's kernels (issue 16 item 2) on the host emulator: the forward in its storing
variant (split statistics + the chunk's raw fp32 logits in one pass, both mainloops) and
``softmax_grad.cu`` (dz from the stored logits); then ``fused_linear_token_loss`` with
``backend="cuda"`` driving them through ``megarl.kernels._cuda`` exactly as on a GPU, against
float64 autograd over the full logits, on one rank and vocab-parallel over TP=2 (gloo).
"""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.kernels import _cuda, linear_loss

from .test_kernels_emulated import MAINLOOPS, _f32, _operands, _read, _run

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
    torch.testing.assert_close(logits[:, :valid].double(), want, rtol=1e-5, atol=1e-5)
    assert logits[:, valid:].isnan().all(), "written past the valid columns"
    for name, shape in (("part", (3, splits, T)), ("label_logit", (T,))):
        assert torch.equal(_read(plain, name, torch.float32, *shape), _read(stored, name, torch.float32, *shape)), name


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
    torch.testing.assert_close(dz[:, :valid].double(), want, rtol=2**-8, atol=1e-6)
    assert dz[:, valid:].isnan().all()


# --------------------------------------------------- the training path through megarl.kernels._cuda


class EmulatedExtension:
    """The entry points of ``megarl._C`` that the logprob and training paths call, run by the
    emulator: same arguments, same outputs (bf16 operands as the bindings take them; here fp32 tensors
    holding bf16 values, as the CPU path hands them over)."""

    TILE_VOCAB, TILE_VOCAB_SM90 = 128, 256

    def __init__(self, exe: Path, workdir: Path):
        self.exe, self.workdir = exe, workdir

    def _dir(self) -> Path:
        return Path(tempfile.mkdtemp(dir=self.workdir))

    def logprob_forward(self, hidden, weight, labels, valid_v, vocab_start, inv_tau, num_splits, wgmma, logits=None):
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
    """float64 autograd through the full logits; also |dz| . |W| and |dz|^T . |h|, the scale of
    the error that rounding dz to bf16 (8 significant bits) may leave in each gradient entry."""
    x = (hidden.double() @ weight[:vocab].double().T).requires_grad_(True)
    logp_all = torch.log_softmax(x / tau, dim=-1)
    hit = (labels >= 0) & (labels < vocab)
    lp = logp_all.gather(1, labels.clamp(0, vocab - 1)[:, None]).squeeze(1) * hit
    ent = -(logp_all.exp() * logp_all).sum(-1)
    loss = _terms(coefs, lp, ent).sum()
    (dz,) = torch.autograd.grad(loss, x)
    d_hidden = dz @ weight[:vocab].double()
    d_weight = torch.zeros(weight.shape, dtype=torch.float64)
    d_weight[:vocab] = dz.T @ hidden.double()
    scale_h = dz.abs() @ weight[:vocab].double().abs()
    scale_w = torch.zeros_like(d_weight)
    scale_w[:vocab] = dz.abs().T @ hidden.double().abs()
    return loss.detach(), lp.detach(), ent.detach(), (d_hidden, scale_h), (d_weight, scale_w)


def _check(got, want, rows: slice | None = None) -> None:
    loss, lp, ent, d_hidden, d_weight = got
    for name, a, b in (("loss", loss, want[0]), ("logprob", lp, want[1]), ("entropy", ent, want[2])):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for name, a, (b, scale) in (("grad_hidden", d_hidden, want[3]), ("grad_weight", d_weight, want[4])):
        if name == "grad_weight" and rows is not None:
            b, scale = b[rows], scale[rows]
        err = (a.double() - b).abs()
        bound = 2**-8 * scale + 1e-5
        assert (err <= bound).all(), (
            f"{name}: max error {err.max():.3g}, worst ratio to the bf16 bound {(err / bound).max():.3g}"
        )


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
