"""The CUDA kernels of csrc/, executed on the CPU: the sm_80 ones and the sm_90a (Hopper) ones.

``tests/kernels/emulator`` compiles the real kernel sources with g++ against a host emulation
of CUDA (a CTA's threads as fibers; cp.async, ldmatrix, mma.sync, the shuffles, mbarrier, TMA
tensor copies, wgmma and setmaxnreg written from the PTX ISA), and its ``run_kernels`` calls
the host launchers of ``csrc/kernels.h`` on inputs that this test writes. The outputs are
checked against float64 computations from the same bf16 inputs and against the torch paths of
``megarl.kernels``, which consume them on a GPU. The logprob forward and backward run on both
mainloops (mma.sync: ``launch_logprob_*``; TMA + wgmma: ``launch_logprob_*_sm90``) with the
same shapes and checks.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import cta_order_model
from megarl.actor import fused_ppo_loss as ppo_module
from megarl.actor.losses import policy_loss
from megarl.kernels.reference import finalize_stats, merge_stats
from tests.numerics import (
    assert_within,
    fast_exp_relative_error,
    gamma,
    ppo_token_relative_error,
    softmax_grad_bound,
    softmax_head_bounds,
    softmax_partial_bounds,
    unit_roundoff,
)

from .conftest import build_emulator

# The vocab rows of one tile, which the forward's splits own whole: kTileVocab (mma.sync) and
# kTileVocabSm90 (wgmma) in csrc/kernels.h. Both take 128 token rows per CTA (kTileTokens).
TILE_VOCAB = {"sm80": 128, "sm90": 256}
MAINLOOPS = list(TILE_VOCAB)
NUM_PPO_STATS = 9  # kNumPPOStats


def _run(
    exe: Path,
    workdir: Path,
    op: list,
    scalars: list,
    inputs: dict[str, torch.Tensor],
    async_mode="late",
    try_wait="suspend",
    cta_group: int | None = None,
) -> None:
    """run_kernels OP... WORKDIR SCALARS... on these inputs, with asynchronous copies landing late
    or early (CUDA_EMU_ASYNC) and mbarrier waits that cannot complete suspended or timed out
    (CUDA_EMU_TRY_WAIT; cuda_host_emu.h); ``cta_group``: the CTA order's token blocks per group
    (CTA_GROUP), else the launchers' default."""
    for name, tensor in inputs.items():
        tensor.contiguous().view(torch.uint8).numpy().tofile(workdir / f"{name}.bin")
    env = {**os.environ, "CUDA_EMU_ASYNC": async_mode, "CUDA_EMU_TRY_WAIT": try_wait}
    if cta_group is not None:
        env["CTA_GROUP"] = str(cta_group)
    cmd = [exe, *op, workdir, *map(str, scalars)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"run_kernels {' '.join(op)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"


def _read(workdir: Path, name: str, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.from_file(str(workdir / f"{name}.bin"), size=math.prod(shape), dtype=dtype).view(*shape)


def _f32(x: float) -> float:
    """x rounded to fp32, the value a launcher's float argument holds."""
    return float(torch.tensor(x, dtype=torch.float32))


def _operands(T, H, rows, start, valid, seed):
    """bf16 hidden [T,H] and weight [rows,H] (logits of a few units), labels around the shard
    (some below it, some in its padding or past it) with a few -100."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    weight = (torch.randn(rows, H, generator=g) * H**-0.5 * 4).bfloat16()
    labels = torch.randint(start - 5, start + rows + 5, (T,), generator=g)
    labels[torch.rand(T, generator=g) < 0.1] = -100
    return hidden, weight, labels


def _logits(hidden, weight, valid, inv_tau) -> torch.Tensor:
    """z [T, valid] in float64 from the bf16 operands."""
    return hidden.double() @ weight[:valid].double().T * inv_tau


def _at_labels(values: torch.Tensor, local: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """values[t, local[t]] where hit[t], else 0."""
    padded = torch.cat([values, values.new_zeros(values.shape[0], 1)], dim=1)
    return padded.gather(1, torch.where(hit, local, values.shape[1])[:, None]).squeeze(1)


def _label_logit_bound(hidden, weight, local, hit, inv_tau) -> torch.Tensor:
    """A label's logit, H products of bf16 operands (exact in fp32) summed in fp32, then scaled by the
    fp32 1/tau: within gamma(H + 1) sum|h w| / tau of exact (tests/numerics.py); 0 where no label."""
    w = weight.double()[local.clamp(0, weight.shape[0] - 1)]
    magnitude = (hidden.double().abs() * w.abs()).sum(dim=1) * inv_tau
    return torch.where(hit, gamma(hidden.shape[1] + 1, torch.float32) * magnitude, 0.0)


def _triple(z: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(max, sum exp(z - max), sum exp(z - max)(z - max)) over the last dim; empty: (-inf, 0, 0)."""
    if z.shape[1] == 0:
        zeros = z.new_zeros(z.shape[0])
        return torch.full_like(zeros, -math.inf), zeros, zeros
    m = z.amax(dim=1)
    d = z - m[:, None]
    e = d.exp()
    return m, e.sum(dim=1), (e * d).sum(dim=1)


# Merges of partial triples a term passes through besides one per vocab tile of its split: the quad's
# two shuffles, the warps' and the split's own (softmax_stats.cuh, logprob_forward_kernel); generous.
MERGES_BESIDE_TILES = 6


def _assert_partials(got: torch.Tensor, hidden, weight, cols: slice, inv_tau: float, tiles: int, what: str):
    """A split's triple [3, T] against the float64 one of the logits in ``cols``, within the derived fp32
    bounds (tests/numerics.py softmax_partial_bounds): logits of H bf16 products summed in fp32."""
    h, w = hidden.double(), weight[cols].double()
    z = h @ w.T * inv_tau
    e_z = gamma(hidden.shape[1] + 1, torch.float32) * (h.abs() @ w.abs().T) * inv_tau
    want = _triple(z)
    if z.shape[1] == 0:  # an empty split is (-inf, 0, 0) exactly
        for name, g, w_ in zip("msu", got, want):
            assert torch.equal(g, w_.to(g.dtype)), f"{what}: empty split's {name}"
        return
    bounds = softmax_partial_bounds(z, e_z, tiles + MERGES_BESIDE_TILES, torch.float32)
    for name, g, w_, b in zip("msu", got, want, (bounds.m, bounds.s, bounds.u)):
        assert_within(g, w_, b, f"{what}: {name}")


# When asynchronous operations take effect. late: copies into shared memory (cp.async, TMA) land
# at the last moment, wgmma reads its operands at issue, so a read before the data has landed
# sees stale data. early: copies land at issue, wgmma reads at its wait_group, so a stage
# refilled while still being read shows.
ASYNC = [pytest.param("late", id="copies-late"), pytest.param("early", id="copies-early")]


def _on_both_mainloops(shapes, skip=lambda mainloop, values: False):
    """Each shape on each mainloop (ids sm80-<shape>, sm90-<shape>), less the pairs `skip` names."""
    return [
        pytest.param(mainloop, *p.values, id=f"{mainloop}-{p.id}")
        for mainloop in MAINLOOPS
        for p in shapes
        if not skip(mainloop, p.values)
    ]


# T, H, rows, valid_v, vocab_start, temperature, num_splits. T off the 128-token tiles, rows off
# both vocab tiles (128, 256); H with a K tail (off the 32- and 64-element stages), shorter than
# one stage, or longer than the 4 stages of both pipelines (the stage ring wraps within a tile);
# padded shards, labels outside the shard; splits with several tiles, a last tile of one column,
# empty splits (more splits than tiles).
FORWARD = [
    pytest.param(1, 40, 130, 130, 0, 1.0, 1, id="one-token"),
    pytest.param(130, 200, 600, 589, 1000, 0.7, 3, id="tails-padded-offset"),
    pytest.param(200, 392, 1300, 1290, 7, 1.0, 2, id="several-tiles-per-split-long-k"),
    pytest.param(300, 256, 300, 257, 50, 1.3, 4, id="one-column-tile-and-empty-split"),
    pytest.param(70, 64, 200, 100, 0, 1.0, 5, id="more-splits-than-tiles"),
    pytest.param(9, 16, 128, 0, 4096, 1.0, 2, id="all-padding-shard"),
]


# The sm_90a launchers require valid_v > 0; bindings.cpp (use_wgmma) takes the mma.sync kernels
# for an all-padding shard.
@pytest.mark.parametrize("async_mode", ASYNC)
@pytest.mark.parametrize(
    "mainloop,T,H,rows,valid,start,tau,splits",
    _on_both_mainloops(FORWARD, skip=lambda mainloop, values: mainloop == "sm90" and values[3] == 0),
)
def test_forward_partials_and_label_logits(
    run_kernels, tmp_path, mainloop, T, H, rows, valid, start, tau, splits, async_mode
):
    hidden, weight, labels = _operands(T, H, rows, start, valid, seed=T + H + rows)
    inv_tau = _f32(1 / tau)
    _run(
        run_kernels,
        tmp_path,
        ["forward", mainloop],
        [T, H, rows, valid, start, repr(inv_tau), splits],
        {"hidden": hidden, "weight": weight, "labels": labels},
        async_mode,
    )
    part = _read(tmp_path, "part", torch.float32, 3, splits, T).double()
    label_logit = _read(tmp_path, "label_logit", torch.float32, T).double()
    z = _logits(hidden, weight, valid, inv_tau)

    # split x owns vocab tiles [x * per_split, (x + 1) * per_split) (logprob_forward_kernel)
    tile = TILE_VOCAB[mainloop]
    per_split = math.ceil(math.ceil(valid / tile) / splits) * tile
    for x in range(splits):
        cols = slice(min(x * per_split, valid), min((x + 1) * per_split, valid))
        _assert_partials(part[:, x], hidden, weight, cols, inv_tau, per_split // tile, f"split {x}")

    local = labels - start
    hit = (local >= 0) & (local < valid)
    assert_within(
        label_logit, _at_labels(z, local, hit), _label_logit_bound(hidden, weight, local, hit, inv_tau), "label logit"
    )

    # as the CUDA path consumes them (_cuda.local_stats, logprob.py): merged, then finalised
    if valid > 0:
        m, s, u = merge_stats(part[0], part[1], part[2])
        logprob, entropy, lse, _ = finalize_stats(m, s, u, label_logit, hit)
        log_p = torch.log_softmax(z, dim=1)
        # float32 accumulation of the bf16 operands' products, then the softmax statistics: the head's
        # derived bounds (tests/numerics.py), the logits scaled by the launcher's fp32 1/tau
        bounds = softmax_head_bounds(
            hidden, weight[:valid], torch.where(hit, local, -1), torch.zeros(2, T), 1 / inv_tau, torch.float32
        )
        assert_within(lse, torch.logsumexp(z, dim=1), bounds.lse, "lse")
        assert_within(entropy, -(log_p.exp() * log_p).sum(dim=1), bounds.entropy, "entropy")
        assert_within(logprob, _at_labels(log_p, local, hit), bounds.logprob, "logprob")


# The forward's fast path (softmax_stats.cuh, fold_row_full) drops the per-column padding and label
# tests in a tile that is wholly valid and does not hold the row's label. Here the padding rows give
# logits far above the real ones, so a partial tile folded on the fast path shows in every statistic,
# and the labels sit on the first and last columns of the tiles and in the last partial tile, so a
# label tile folded on it leaves its label logit at 0. Other rows still fold those tiles fast.
@pytest.mark.parametrize("mainloop", MAINLOOPS)
def test_forward_fast_path_only_on_full_tiles_without_the_label(run_kernels, tmp_path, mainloop):
    tile = TILE_VOCAB[mainloop]
    T, H, valid, tau = 130, 24, 2 * tile + 3, 0.7
    rows = valid + 9
    hidden, weight, _ = _operands(T, H, rows, 0, valid, seed=11)
    weight[valid:] *= 64  # padding logits ~64x the real ones
    edges = [0, tile - 1, tile, 2 * tile - 1, 2 * tile, valid - 1]
    labels = torch.tensor(edges * (T // len(edges) + 1))[:T]
    inv_tau = _f32(1 / tau)
    _run(
        run_kernels,
        tmp_path,
        ["forward", mainloop],
        [T, H, rows, valid, 0, repr(inv_tau), 1],
        {"hidden": hidden, "weight": weight, "labels": labels},
    )
    part = _read(tmp_path, "part", torch.float32, 3, 1, T).double()
    label_logit = _read(tmp_path, "label_logit", torch.float32, T).double()
    z = _logits(hidden, weight, valid, inv_tau)
    _assert_partials(part[:, 0], hidden, weight, slice(0, valid), inv_tau, math.ceil(valid / tile), "triple")
    everywhere = torch.ones_like(labels, dtype=torch.bool)
    bound = _label_logit_bound(hidden, weight, labels, everywhere, inv_tau)
    assert_within(label_logit, z.gather(1, labels[:, None]).squeeze(1), bound, "label logit")


# T, H, rows, valid_v, vocab_start, temperature, col_begin, col_count, ld: column ranges that
# start off a tile, end off a tile (also at an odd column), run into the padding rows, span
# several column tiles with a K loop longer than the stage ring, and a dz row stride wider than
# the range.
BACKWARD = [
    pytest.param(1, 40, 130, 130, 0, 1.0, 0, 130, 130, id="one-token"),
    pytest.param(130, 200, 600, 589, 1000, 0.7, 130, 300, 310, id="offset-range-wide-stride"),
    pytest.param(300, 256, 600, 589, 0, 1.3, 400, 199, 202, id="into-padding-odd-count"),
    pytest.param(140, 392, 900, 850, 3, 1.0, 2, 846, 848, id="several-column-tiles-long-k"),
]


@pytest.mark.parametrize("async_mode", ASYNC)
@pytest.mark.parametrize("mainloop,T,H,rows,valid,start,tau,col_begin,col_count,ld", _on_both_mainloops(BACKWARD))
def test_backward_dz(
    run_kernels, tmp_path, mainloop, T, H, rows, valid, start, tau, col_begin, col_count, ld, async_mode
):
    hidden, weight, labels = _operands(T, H, rows, start, valid, seed=T + H + rows + 1)
    inv_tau = _f32(1 / tau)
    z_valid = _logits(hidden, weight, valid, inv_tau)
    g = torch.Generator().manual_seed(T)
    local = labels - start
    hit = (local >= 0) & (local < valid)
    vectors = {
        "lse": torch.logsumexp(z_valid, dim=1).float(),
        "mean_z": (torch.softmax(z_valid, dim=1) * z_valid).sum(dim=1).float(),
        "g_lp": torch.where(hit, torch.randn(T, generator=g), 0.0),  # zero for ignored labels
        "g_ent": torch.randn(T, generator=g),
    }
    _run(
        run_kernels,
        tmp_path,
        ["backward", mainloop],
        [T, H, rows, valid, start, repr(inv_tau), col_begin, col_count, ld],
        {"hidden": hidden, "weight": weight, "labels": labels, **vectors},
        async_mode,
    )
    dz = _read(tmp_path, "dz", torch.bfloat16, T, ld)
    assert dz[:, col_count:].isnan().all(), "dz written past col_count"
    got = dz[:, :col_count].double()

    cols = torch.arange(col_begin, col_begin + col_count)
    z = hidden.double() @ weight[cols].double().T * inv_tau  # [T, col_count]
    lse, mean_z, g_lp, g_ent = (vectors[k].double()[:, None] for k in ("lse", "mean_z", "g_lp", "g_ent"))
    p = (z - lse).exp()
    onehot = (cols[None, :] == local[:, None]).double()
    want = inv_tau * (g_lp * (onehot - p) - g_ent * p * (z - mean_z))
    padding = (cols >= valid)[None, :].expand_as(want)
    assert (got[padding] == 0).all(), "padding rows must get a zero gradient"

    # dz is fp32 arithmetic (softmax_stats.cuh softmax_grad) rounded once to bf16
    e_z = gamma(H + 1, torch.float32) * (hidden.double().abs() @ weight[cols].double().abs().T) * inv_tau
    bound = _dz_bound(z, e_z, lse, mean_z, g_lp, g_ent, onehot, inv_tau)
    assert_within(got[~padding], want[~padding], bound[~padding], "dz")


def _cta_order(run_kernels, cols: int, rows: int, group: int) -> list[tuple[int, int]]:
    """(column block, token block) of each CTA index in turn: cta_order.cuh's grouped_tile."""
    proc = subprocess.run(
        [run_kernels, "cta_order", str(cols), str(rows), str(group)], check=True, capture_output=True, text=True
    )
    return [tuple(map(int, line.split())) for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("cols,rows", [(1, 1), (3, 5), (16, 32), (7, 12), (5, 3)])
@pytest.mark.parametrize("group", [1, 2, 4, 16, 64])
def test_the_cta_order_takes_every_tile_once_in_groups_of_token_blocks(run_kernels, cols, rows, group):
    order = _cta_order(run_kernels, cols, rows, group)
    assert sorted(order) == [(c, r) for c in range(cols) for r in range(rows)], "a bijection onto the tiles"
    assert order == [
        (c, r) for g0 in range(0, rows, group) for c in range(cols) for r in range(g0, min(g0 + group, rows))
    ]
    if group == 1:  # the order of the first kernels: every column block of a token block, then the next
        assert order == [(c, r) for r in range(rows) for c in range(cols)]
    assert order == cta_order_model.launch_order(cols, rows, group)  # what the L2 model replays


# The CTA order changes which CTA computes a tile, never what it computes: forward partials, label
# logits and the backward's dz are the same bits under every group (5 token blocks: groups of 2 end
# in a group of one; 16 covers them all in one group).
@pytest.mark.parametrize("mainloop", MAINLOOPS)
def test_the_cta_order_changes_no_result(run_kernels, tmp_path, mainloop):
    T, H, rows, valid, start, splits = 600, 48, 800, 777, 5, 3
    hidden, weight, labels = _operands(T, H, rows, start, valid, seed=3)
    inv_tau = _f32(1 / 0.9)
    g = torch.Generator().manual_seed(4)
    vectors = {name: torch.randn(T, generator=g) for name in ("lse", "mean_z", "g_lp", "g_ent")}
    inputs = {"hidden": hidden, "weight": weight, "labels": labels, **vectors}
    results = {}
    for group in (1, 2, 16):
        work = tmp_path / f"group{group}"
        work.mkdir()
        scalars = [T, H, rows, valid, start, repr(inv_tau)]
        _run(run_kernels, work, ["forward", mainloop], [*scalars, splits], inputs, cta_group=group)
        _run(run_kernels, work, ["backward", mainloop], [*scalars, 2, 700, 700], inputs, cta_group=group)
        results[group] = [
            _read(work, "part", torch.float32, 3, splits, T),
            _read(work, "label_logit", torch.float32, T),
            _read(work, "dz", torch.bfloat16, T, 700).float(),
        ]
        assert not any(x.isnan().any() for x in results[group]), f"group {group}: a tile left unwritten"
    for group in (2, 16):
        for name, got, want in zip(("part", "label_logit", "dz"), results[group], results[1]):
            assert torch.equal(got, want), f"{mainloop} {name}: group {group} differs from group 1"


def _dz_bound(z, e_z, lse, mean_z, g_lp, g_ent, onehot, inv_tau) -> torch.Tensor:
    """softmax_grad in fp32 from logits within e_z of z (lse, mean_z and the upstream gradients its exact
    fp32 inputs), rounded once to bf16: tests/numerics.py softmax_grad_bound."""
    lse, mean_z, g_lp, g_ent = (x.reshape(-1) for x in (lse, mean_z, g_lp, g_ent))  # [T] or [T, 1]
    return softmax_grad_bound(z, e_z, lse, mean_z, g_lp, g_ent, onehot, inv_tau, out_dtype=torch.bfloat16)


# T, prox_logp given, dual clip, behaviour-weight cap, share of masked-in tokens: several CTAs
# with a grid-stride loop, one token, and a batch with no masked-in token.
PPO = [
    pytest.param(3000, True, 3.0, 1.2, 0.8, id="decoupled-dual-clip-cap"),
    pytest.param(777, False, 3.0, None, 0.8, id="dual-clip"),
    pytest.param(1, False, None, None, 1.0, id="one-token"),
    pytest.param(50, True, None, 1.5, 0.0, id="nothing-masked-in"),
]


@pytest.mark.parametrize("T,use_prox,dual_clip,cap,kept", PPO)
def test_ppo_loss(run_kernels, tmp_path, T, use_prox, dual_clip, cap, kept):
    g = torch.Generator().manual_seed(T)
    old = -torch.rand(T, generator=g) * 3
    logp = old + 0.4 * torch.randn(T, generator=g)
    prox = old + 0.2 * torch.randn(T, generator=g) if use_prox else None
    adv = torch.randn(T, generator=g)
    mask = torch.rand(T, generator=g) < kept
    eps_low, eps_high = 0.2, 0.28
    inputs = {"logp": logp, "old_logp": old, "adv": adv, "mask": mask}
    if use_prox:
        inputs["prox_logp"] = prox
    _run(run_kernels, tmp_path, ["ppo"], [T, eps_low, eps_high, dual_clip or 0.0, cap or 0.0, int(use_prox)], inputs)
    loss_tok = _read(tmp_path, "loss_tok", torch.float32, T)
    grad_tok = _read(tmp_path, "grad_tok", torch.float32, T)
    stats = _read(tmp_path, "stats", torch.float32, NUM_PPO_STATS)

    # the torch path of megarl.actor.fused_ppo_loss: policy_loss under autograd and its raw stats
    x = logp.clone().requires_grad_(True)
    out = policy_loss(
        x,
        old,
        adv,
        mask,
        eps_clip=eps_low,
        eps_clip_higher=eps_high,
        c_clip=dual_clip,
        proximal_logprobs=prox,
        behav_imp_weight_cap=cap,
    )
    out.loss.sum().backward()
    anchor = old if prox is None else prox
    torch_stats = ppo_module._raw_stats(out, logp - anchor, mask)
    # per token, both float32 results against the float64 loss within the derived PPO bound
    exact = logp.double().requires_grad_(True)
    out64 = policy_loss(
        exact,
        old.double(),
        adv.double(),
        mask,
        eps_clip=eps_low,
        eps_clip_higher=eps_high,
        c_clip=dual_clip,
        proximal_logprobs=None if prox is None else prox.double(),
        behav_imp_weight_cap=cap,
    )
    out64.loss.sum().backward()
    u = unit_roundoff(torch.float32)
    exact_stats = ppo_module._raw_stats(out64, logp.double() - anchor.double(), mask)
    stats_bound = _ppo_stats_bound(out64, logp, anchor, old, prox, mask)
    for name, got_loss, got_grad, got_stats, fast_exp in (
        ("kernel", loss_tok, grad_tok, stats, True),
        ("torch path", out.loss.detach(), x.grad, torch_stats, False),
    ):
        rel = ppo_token_relative_error(logp, old, prox, torch.float32, fast_exp=fast_exp)
        assert_within(got_loss, out64.loss.detach(), rel * out64.loss.detach().abs(), f"{name} loss per token")
        assert_within(got_grad, exact.grad, (rel + u) * exact.grad.abs(), f"{name} gradient per token")
        finite = exact_stats.isfinite()  # the min ratio of no token is +inf on both
        assert torch.equal(got_stats[~finite].double(), exact_stats[~finite]), f"{name} stats"
        assert_within(got_stats[finite], exact_stats[finite], stats_bound[finite], f"{name} stats")


def _ppo_stats_bound(out64, logp, anchor, old, prox, mask) -> torch.Tensor:
    """Bounds of the kernel's raw PPO statistics (fused_ppo_loss._raw_stats order) computed in fp32 with
    CUDA's fast exp, against float64 ones: the counts are exact (the data keep clear of the clip and cap
    boundaries); a token's log-ratio x is rounded once and its ratio exp(x) is within
    r (u |x| + fast-exp error), likewise the behaviour weight; the sums of the n kept tokens add
    gamma(n) sum |term|; the max and min ratio are within the largest ratio error."""
    u = unit_roundoff(torch.float32)
    x = logp.double() - anchor.double()
    ratio = out64.ratio.detach().double()
    e_ratio = torch.where(mask, ratio * (u * x.abs() + fast_exp_relative_error(x)), 0.0)
    e_kl = torch.where(mask, u * x.abs(), 0.0)
    if prox is None:
        weight, e_weight = torch.where(mask, 1.0, 0.0), torch.zeros_like(x)
    else:
        x_w = prox.double() - old.double()
        weight = torch.where(mask & ~out64.capped, out64.behav_weight.double(), 0.0)
        e_weight = weight * (u * x_w.abs() + fast_exp_relative_error(x_w))
    g = gamma(max(int(mask.sum()), 1), torch.float32)

    def summed(terms, errors):
        return errors.sum() + g * terms.abs().sum()

    extreme = e_ratio.max()
    return torch.stack(
        [
            *[torch.zeros((), dtype=torch.float64)] * 3,  # kept, clipped, dual-clipped: counts
            summed(torch.where(mask, ratio, 0.0), e_ratio),
            summed(torch.where(mask, x, 0.0), e_kl),
            summed(weight, e_weight),
            torch.zeros((), dtype=torch.float64),  # capped: a count
            extreme,
            extreme,
        ]
    )


def _hang(exe: Path, try_wait: str, **env: str) -> subprocess.CompletedProcess:
    """run_kernels mbar_hang: thread 37 of CTA (2, 1) waits for an mbarrier phase that never completes."""
    env = {**os.environ, "CUDA_EMU_TRY_WAIT": try_wait, **env}
    return subprocess.run(
        [exe, "mbar_hang", "2", "1", "37"], check=False, capture_output=True, text=True, timeout=60, env=env
    )


def _time_out_ns(proc: subprocess.CompletedProcess) -> int:
    """How long the trapping thread says it waited; also checks where it says it waited."""
    assert proc.returncode != 0 and "the kernel returned" not in proc.stdout, proc.stdout + proc.stderr
    message = re.search(
        r"megarl: mbarrier wait timed out after (\d+) ns: block \((\d+),(\d+),0\) thread (\d+) "
        r"waits for parity (\d) of the mbarrier",
        proc.stdout,
    )
    assert message, f"no time-out message in stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    waited, bx, by, thread, parity = map(int, message.groups())
    assert (bx, by, thread, parity) == (2, 1, 37, 0)
    assert "__trap() in thread (37,0,0) of CTA (2,1,0)" in proc.stderr
    return waited


def test_a_wait_that_never_completes_traps_with_its_place(run_kernels):
    """With try_wait answering false after its time limit, as the hardware's does, mbar_wait's own
    bound (4 s of %globaltimer by default) ends the wait: the thread prints where it waited, then traps."""
    waited = _time_out_ns(_hang(run_kernels, "time-limit"))
    assert 4_000_000_000 < waited < 4_200_000_000  # the bound, passed by less than one try_wait limit


def test_the_wait_bound_is_right_across_the_wrap_of_its_tick_count(run_kernels):
    """The wait keeps 32 bits of 1024-ns ticks, which wrap every 2^42 ns: started 1 s before a wrap,
    the signed difference of the readings still gives 4 s, neither an early nor a missed time-out."""
    waited = _time_out_ns(_hang(run_kernels, "time-limit", CUDA_EMU_GLOBALTIMER_START=str(2**42 - 10**9)))
    assert 4_000_000_000 < waited < 4_200_000_000


def test_the_wait_bound_is_set_at_build_time(tmp_path):
    """-DMEGARL_MBAR_TIMEOUT_NS (MEGARL_NVCC_FLAGS on a GPU) replaces the 4 s default."""
    exe = build_emulator(tmp_path / "run_kernels", "-DMEGARL_MBAR_TIMEOUT_NS=250000000")
    waited = _time_out_ns(_hang(exe, "time-limit"))
    assert 250_000_000 < waited < 350_000_000  # 0.25 s, passed by less than one 0.1 s try_wait limit


def test_a_refused_tensor_map_names_the_driver_error_and_its_parameters(run_kernels):
    """TMA needs a 16-byte aligned address: the launch fails, and its error says what the driver
    refused (bindings.cpp appends the same detail to the exception)."""
    proc = subprocess.run([run_kernels, "tma_refused"], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "launch_logprob_forward_sm90 returned cudaError 1: cuTensorMapEncodeTiled returned " in proc.stderr
    assert "CUDA_ERROR_INVALID_VALUE (1) for the hidden tensor map [dtype bf16, rank 2, address 0x" in proc.stderr
    assert "dims {64, 5}, strides {128} bytes, box {64, 128}, element strides {1, 1}" in proc.stderr


def test_without_a_time_limit_the_emulator_reports_the_deadlock(run_kernels):
    proc = _hang(run_kernels, "suspend")
    assert proc.returncode != 0
    assert "thread (37,0,0) waits at mbarrier.try_wait.parity for parity 0" in proc.stderr, proc.stderr
    assert "deadlock in CTA (2,1,0)" in proc.stderr and "timed out" not in proc.stdout


def test_a_working_pipeline_never_times_out(run_kernels, tmp_path):
    """The Hopper forward gives the same bits whether a stuck try_wait suspends or times out: its
    waits always complete, so the bound never fires."""
    hidden, weight, labels = _operands(130, 200, 600, 1000, 589, seed=7)
    out = {}
    for mode in ("suspend", "time-limit"):
        workdir = tmp_path / mode
        workdir.mkdir()
        _run(
            run_kernels,
            workdir,
            ["forward", "sm90"],
            [130, 200, 600, 589, 1000, 1.0, 3],
            {"hidden": hidden, "weight": weight, "labels": labels},
            try_wait=mode,
        )
        out[mode] = _read(workdir, "part", torch.float32, 3, 3, 130)
    assert torch.equal(out["suspend"], out["time-limit"]) and not out["suspend"].isnan().any()


def _planted(want: torch.Tensor, bound: torch.Tensor, factor: float) -> torch.Tensor:
    """want with its element of the largest bound moved ``factor`` bounds away."""
    got = want.clone()
    worst = int(bound.flatten().argmax())
    got.view(-1)[worst] += factor * bound.flatten()[worst]
    return got


def test_each_derived_bound_rejects_an_error_just_above_it():
    """The split partials', dz's and the PPO statistics' bounds are not vacuous: the exact values with one
    element moved 1.01 bounds away fail, 0.99 bounds pass."""
    T, H, V, tau = 40, 64, 300, 0.7
    hidden, weight, labels = _operands(T, H, V, 0, V, seed=5)
    z = _logits(hidden, weight, V, 1 / tau)
    e_z = gamma(H + 1, torch.float32) * (hidden.double().abs() @ weight.double().abs().T) / tau
    partial = softmax_partial_bounds(z, e_z, 3 + MERGES_BESIDE_TILES, torch.float32)
    g = torch.Generator().manual_seed(6)
    lse, mean_z = torch.logsumexp(z, dim=1)[:, None], (z.softmax(dim=1) * z).sum(dim=1)[:, None]
    g_lp, g_ent = torch.randn(T, 1, generator=g).double(), torch.randn(T, 1, generator=g).double()
    onehot = torch.nn.functional.one_hot(labels.clamp(0, V - 1), V).double()
    dz = (g_lp * (onehot - (z - lse).exp()) - g_ent * (z - lse).exp() * (z - mean_z)) / tau
    old = -torch.rand(T, generator=g) * 3
    logp, prox = old + 0.4 * torch.randn(T, generator=g), old + 0.2 * torch.randn(T, generator=g)
    mask = torch.rand(T, generator=g) < 0.8
    out64 = policy_loss(
        logp.double(),
        old.double(),
        torch.randn(T, generator=g).double(),
        mask,
        eps_clip=0.2,
        proximal_logprobs=prox.double(),
    )
    stats = ppo_module._raw_stats(out64, logp.double() - prox.double(), mask)[3:6]  # the three sums
    checks = {
        **{f"partial {name}": (want, getattr(partial, name)) for name, want in zip("msu", _triple(z))},
        "dz": (dz, _dz_bound(z, e_z, lse, mean_z, g_lp, g_ent, onehot, 1 / tau)),
        "ppo sums": (stats, _ppo_stats_bound(out64, logp, prox, old, prox, mask)[3:6]),
    }
    for what, (want, bound) in checks.items():
        assert bound.min() >= 0 and bound.max() > 0, what
        assert_within(_planted(want, bound, 0.99), want, bound, what)
        with pytest.raises(AssertionError, match=f"{what}: 1 of"):
            assert_within(_planted(want, bound, 1.01), want, bound, what)
