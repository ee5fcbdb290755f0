"""The self-check that the CUDA kernels pass on a device before a process uses them.

A mainloop (sm90: TMA + wgmma, sm80: mma.sync) runs a small problem through the drivers of
``megarl.kernels._cuda`` exactly as training calls them, and every output is compared with the
exact torch reference (``megarl.kernels.reference``'s arithmetic) in float64:

- the forward: split statistics merged into logprob and entropy (``local_stats``);
- the recomputing backward: dz chunks of 128 columns, then the two gradient GEMMs (``grads``);
- the training path: the storing forward's raw logits and statistics (``logits_and_stats``), then
  the softmax gradient of the stored logits (``softmax_grad_stored``);
- truncation replay: both backward kernels again with a per-token threshold (``threshold=``; two
  rows in three keep their 16 to 24 largest logits, the third none dropped) and the truncated
  softmax's lse and E[z].

The problem is small (a few million multiply-adds: milliseconds on a GPU) but ragged where the
kernels' index arithmetic has edges: 130 tokens (a full 128-token tile and a partial one), a
hidden size of 72 (a K tail off both mainloops' stages), a 300-row shard of which 289 rows are
real vocabulary (a partial last vocab tile on both the 128- and the 256-row tiles, and padding)
starting at global id 1000 as under tensor parallelism, and labels on the tile edges (local 0,
127, 128, 255, 256 and the last real row 288), in the padding, on another rank's shard and -100.

Which path a process then takes, and the fallback when a check fails, is ``_cuda.kernel_path``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.kernels.reference import VocabShard, _label_in_chunk, chunk_triple, finalize_stats, softmax_grad_

TOKENS, HIDDEN, ROWS, VALID, VOCAB_START, TEMPERATURE = 130, 72, 300, 289, 1000, 0.7
EDGE_LABELS = (0, 127, 128, 255, 256, VALID - 1)  # local rows on the 128- and 256-row tile edges
DZ_CHUNK = 128  # the backward's column chunk: three chunks, the last one partial and odd
KEPT = range(16, 25)  # tokens a truncated row keeps: where its logits have the widest gap

# (atol, rtol) of each output against the float64 reference. The statistics and the logits are
# fp32 accumulations of a K = 72 dot product (errors near 1e-6; --use_fast_math's exp adds about
# 2^-22 relative); dz is rounded to bf16 (up to 2^-8 relative) and the gradient GEMMs read that bf16 dz,
# so their bound is relative to sum |dz| |operand| (the scale of that rounding's error, plus the
# rounding of the bf16 d_weight and, off CUDA, of bf16 partial sums). A kernel
# that misses or misplaces a tile, a row or a label is off by the size of the values themselves.
TOLERANCES = {
    "logits": (1e-4, 1e-4),
    "logprob": (1e-4, 1e-4),
    "entropy": (1e-4, 1e-4),
    "dz": (1e-5, 2**-7),
    "gradients": (1e-5, 2**-6),
}


@dataclass(frozen=True)
class Drivers:
    """The functions of ``_cuda`` the check calls, each taking ``mainloop=`` ("sm80" or "sm90")."""

    local_stats: Callable
    logits_and_stats: Callable
    softmax_grad_stored: Callable
    grads: Callable


@dataclass(frozen=True)
class CheckResult:
    """One mainloop's self-check on one device: the output nearest to (or furthest beyond) its
    tolerance, and how far."""

    mainloop: str
    max_diff: float = math.nan  # that output's largest |kernel - reference|; nan if the check did not finish
    worst: str = ""  # that output
    ratio: float = math.nan  # max_diff over its tolerance: <= 1 passes
    error: str | None = None  # why it failed: an exception (a CUDA error), or the output beyond its tolerance

    @property
    def passed(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        if self.passed:
            return f"verified: max |diff| {self.max_diff:.2g} in {self.worst}, {self.ratio:.2g} of its tolerance"
        return f"failed its self-check: {self.error}"


@dataclass(frozen=True)
class _Problem:
    hidden: torch.Tensor  # [T, H] bf16
    weight: torch.Tensor  # [ROWS, H] bf16
    labels: torch.Tensor  # [T] global ids
    shard: VocabShard
    inv_tau: float
    g_lp: torch.Tensor  # [T] fp32, 0 where the label is not in the shard
    g_ent: torch.Tensor  # [T] fp32


def _problem(device: torch.device) -> _Problem:
    """The check's operands, the same on every device (drawn on the CPU from a fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    weight = (torch.randn(ROWS, HIDDEN, generator=g) * HIDDEN**-0.5 * 4).bfloat16()  # logits of a few units
    local = torch.randint(0, VALID, (TOKENS,), generator=g)
    local[: len(EDGE_LABELS)] = torch.tensor(EDGE_LABELS)
    labels = local + VOCAB_START
    labels[-4:] = torch.tensor([-100, VOCAB_START - 1, VOCAB_START + VALID, VOCAB_START + ROWS - 1])
    inside = (labels >= VOCAB_START) & (labels < VOCAB_START + VALID)
    g_lp = torch.where(inside, torch.randn(TOKENS, generator=g), 0.0)
    g_ent = torch.randn(TOKENS, generator=g)
    return _Problem(
        *(t.to(device) for t in (hidden, weight, labels)),
        VocabShard(start=VOCAB_START, valid=VALID, vocab_size=VOCAB_START + VALID),
        1.0 / TEMPERATURE,
        *(t.to(device) for t in (g_lp, g_ent)),
    )


@dataclass(frozen=True)
class _Reference:
    raw: torch.Tensor  # hidden . weight^T [T, VALID]
    logprob: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    mean_z: torch.Tensor
    inside: torch.Tensor  # the label is a real row of the shard
    dz: torch.Tensor  # dL/dx = dL/dz / tau [T, VALID]
    truncated: _Truncated


@dataclass(frozen=True)
class _Truncated:
    """The truncated softmax the check's threshold keeps."""

    theta: torch.Tensor  # [T] fp32, units of z; -inf on every third row (nothing dropped)
    lse: torch.Tensor
    mean_z: torch.Tensor
    dz: torch.Tensor  # dL/dx with p = 0 below theta [T, VALID]


def _reference(p: _Problem) -> _Reference:
    """The torch reference's arithmetic over the whole shard at once, in float64."""
    raw = p.hidden.double() @ p.weight[: p.shard.valid].double().T
    z = raw * p.inv_tau
    idx, inside = _label_in_chunk(p.labels - p.shard.start, 0, p.shard.valid)
    label_logit = torch.where(inside, z.gather(1, idx[:, None]).squeeze(1), 0.0)
    logprob, entropy, lse, mean_z = finalize_stats(*chunk_triple(z), label_logit, inside)
    prob = (z - lse[:, None]).exp()
    dz = softmax_grad_(z.clone(), prob, mean_z, p.g_lp.double(), p.g_ent.double(), idx, inside) * p.inv_tau
    return _Reference(raw, logprob, entropy, lse, mean_z, inside, dz, _truncated(p, z, idx, inside))


def _truncated(p: _Problem, z: torch.Tensor, idx: torch.Tensor, inside: torch.Tensor) -> _Truncated:
    """A threshold halfway across the widest gap between a row's k-th and (k+1)-th largest z for k
    in KEPT (a gap of tenths: the kernels' fp32 logits fall on the same side as these float64
    ones), and the reference's gradient under it."""
    top = z.topk(KEPT.stop, dim=1).values  # [T, 25] descending
    gaps = top[:, KEPT.start - 1 : KEPT.stop - 1] - top[:, KEPT.start : KEPT.stop]
    k = gaps.argmax(dim=1, keepdim=True) + KEPT.start - 1  # [T, 1]: the last kept
    theta = (top.gather(1, k) + top.gather(1, k + 1)).squeeze(1) / 2
    theta[::3] = -math.inf
    kept = z >= theta[:, None]
    lse = torch.where(kept, z, -math.inf).logsumexp(dim=1)
    prob = torch.where(kept, (z - lse[:, None]).exp(), 0.0)
    mean_z = (prob * z).sum(dim=1)
    dz = softmax_grad_(z.clone(), prob, mean_z, p.g_lp.double(), p.g_ent.double(), idx, inside) * p.inv_tau
    return _Truncated(theta.float(), lse, mean_z, dz)


@dataclass(frozen=True)
class _Diff:
    name: str
    max_abs: float  # nan where the kernel left NaN
    ratio: float  # the largest |diff| / tolerance; > 1 fails (a NaN counts as infinite)
    nans: int = 0

    def describe(self) -> str:
        if self.nans:
            return f"{self.name}: {self.nans} values are NaN"
        return f"{self.name} off by up to {self.max_abs:.3g}, {self.ratio:.3g} times its tolerance"


def _diff(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> _Diff:
    err = (got.double() - want).abs()
    nans = int(err.isnan().sum())
    if nans:
        return _Diff(name, math.nan, math.inf, nans)
    return _Diff(name, err.max().item(), (err / bound).max().item())


def _close(name: str, got: torch.Tensor, want: torch.Tensor, kind: str | None = None) -> _Diff:
    atol, rtol = TOLERANCES[kind or name]
    return _diff(name, got, want, atol + rtol * want.abs())


def _stats_diffs(prefix: str, stats: tuple[torch.Tensor, ...], ref: _Reference) -> list[_Diff]:
    logprob, entropy, _, _ = finalize_stats(*(t.double() for t in stats), ref.inside)
    return [
        _close(f"{prefix} logprob", logprob, ref.logprob, "logprob"),
        _close(f"{prefix} entropy", entropy, ref.entropy, "entropy"),
    ]


def _gradient_diffs(p: _Problem, dz: torch.Tensor, d_hidden, d_weight, prefix: str = "backward") -> list[_Diff]:
    atol, rtol = TOLERANCES["gradients"]
    weight, hidden = p.weight[: p.shard.valid].double(), p.hidden.double()
    rows = p.shard.valid
    padding = torch.zeros_like(d_weight[rows:], dtype=torch.float64)
    return [
        _diff(f"{prefix} d_hidden", d_hidden, dz @ weight, atol + rtol * (dz.abs() @ weight.abs())),
        _diff(f"{prefix} d_weight", d_weight[:rows], dz.T @ hidden, atol + rtol * (dz.abs().T @ hidden.abs())),
        _diff(f"{prefix} padding rows", d_weight[rows:], padding, 1e-30),
    ]


def _compare(drivers: Drivers, p: _Problem, ref: _Reference, mainloop: str) -> list[_Diff]:
    """Every output of the mainloop's kernels against the reference."""
    args = (p.hidden, p.weight, p.labels, p.shard, p.inv_tau)
    diffs = _stats_diffs("forward", drivers.local_stats(*args, mainloop=mainloop), ref)
    logits, *stats = drivers.logits_and_stats(*args, mainloop=mainloop)
    diffs.append(_close("training logits", logits[:, : p.shard.valid], ref.raw, "logits"))
    diffs += _stats_diffs("training", tuple(stats), ref)
    vectors = [t.float() for t in (ref.lse, ref.mean_z)] + [p.g_lp, p.g_ent]
    dz = drivers.softmax_grad_stored(logits, p.labels, p.shard, p.inv_tau, *vectors)
    diffs.append(_close("training dz", dz, ref.dz, "dz"))
    d_hidden, d_weight = drivers.grads(*args, *vectors, DZ_CHUNK, mainloop=mainloop)
    diffs += _gradient_diffs(p, ref.dz, d_hidden, d_weight)
    # truncation replay: the same kernels with the threshold
    cut = ref.truncated
    vectors = [t.float() for t in (cut.lse, cut.mean_z)] + [p.g_lp, p.g_ent]
    dz = drivers.softmax_grad_stored(logits, p.labels, p.shard, p.inv_tau, *vectors, threshold=cut.theta)
    diffs.append(_close("truncated training dz", dz, cut.dz, "dz"))
    d_hidden, d_weight = drivers.grads(*args, *vectors, DZ_CHUNK, mainloop=mainloop, threshold=cut.theta)
    return diffs + _gradient_diffs(p, cut.dz, d_hidden, d_weight, "truncated backward")


def run_check(drivers: Drivers, device: torch.device, mainloop: str) -> CheckResult:
    """The mainloop's self-check on ``device``: passed, or failed with the error or the output
    furthest beyond its tolerance."""
    problem = _problem(device)
    try:
        diffs = _compare(drivers, problem, _reference(problem), mainloop)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an asynchronous CUDA error surfaces here, inside the check
    except Exception as exc:  # noqa: BLE001 (any failure of the kernels is the check's answer)
        return CheckResult(mainloop, error=f"{type(exc).__name__}: {exc}")
    worst = max(diffs, key=lambda d: d.ratio)
    result = CheckResult(mainloop, worst.max_abs, worst.name, worst.ratio)
    if worst.ratio <= 1:
        return result
    return dataclasses.replace(result, error=worst.describe())
