"""Small updates reach bf16 weights: the fp32 main parameters are dithered within their bf16 cell.

Weights loaded from a bf16 (or rounded fp32) checkpoint sit exactly on the bf16 grid, and with
Megatron's round-to-nearest copy an element changes only once its summed updates pass half a
grid step: at RL learning rates most weights never move (``benchmarks/bf16_update.py`` measured
2% of fp32's policy movement after one step of SmolLM2-135M). Dithering the main parameters
keeps the loaded model bit for bit and makes the rounded weights follow the main parameters in
expectation.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.actor.optim import dither_main_params, main_params_of_low_precision
from megarl.config.allocation import AllocationMode
from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_batch


def _on_grid(dtype: torch.dtype, n: int = 200_000, seed: int = 0) -> torch.Tensor:
    """fp32 values already representable in ``dtype`` (what a bf16 checkpoint loads as), incl. zeros."""
    values = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype).float()
    values[::97] = 0.0
    return values


def _fake_optimizer(mains: list[torch.Tensor], distributed: bool = False):
    """The attributes of Megatron's two mixed-precision optimizers, inside a chained optimizer."""
    groups = [mains]
    inner = (
        SimpleNamespace(shard_fp32_from_float16_groups=groups)
        if distributed
        else SimpleNamespace(fp32_from_float16_groups=groups)
    )
    return SimpleNamespace(chained_optimizers=[inner])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dither_keeps_the_rounded_model_and_stays_within_the_cell(dtype):
    loaded = _on_grid(dtype)
    main = loaded.clone()
    dither_main_params(_fake_optimizer([main]), dtype)
    assert torch.equal(main.to(dtype), loaded.to(dtype)), "dithering changed the weights the model computes with"
    assert torch.equal(main[loaded == 0], loaded[loaded == 0])
    moved = (main != loaded).float().mean().item()
    assert moved > 0.95, f"only {moved:.1%} of the main parameters left the grid"
    # offsets spread over the cell: |offset| / half-step roughly uniform on [0, 1)
    _, exponent = torch.frexp(loaded)
    half_step = torch.ldexp(torch.ones_like(loaded), exponent - 2 - (7 if dtype == torch.bfloat16 else 10))
    nonzero = loaded != 0
    spread = ((main - loaded).abs() / half_step)[nonzero]
    assert spread.max() <= 1 and 0.45 < spread.mean() < 0.55


@pytest.mark.parametrize("distributed", [False, True])
def test_small_updates_reach_the_rounded_weights_in_expectation(distributed):
    """An update of a tenth of a grid step moves the bf16 weights by a tenth of a step on average;
    without the dither it moves nothing (the failure this guards against)."""
    loaded = _on_grid(torch.bfloat16)
    nonzero = loaded != 0
    _, exponent = torch.frexp(loaded)
    step = torch.ldexp(torch.ones_like(loaded), exponent - 8)
    for dithered, want in ((True, 0.1), (False, 0.0)):
        main = loaded.clone()
        optimizer = _fake_optimizer([main], distributed)
        assert main_params_of_low_precision(optimizer) == [main]
        if dithered:
            dither_main_params(optimizer, torch.bfloat16)
        update = 0.1 * step * torch.sign(torch.randn(main.shape, generator=torch.Generator().manual_seed(1)))
        moved = ((main + update).to(torch.bfloat16).float() - loaded) / update
        assert moved[nonzero].mean().item() == pytest.approx(want * 10, abs=0.03)


def test_dither_is_the_same_on_every_replica():
    """Data-parallel replicas (and tensor-parallel copies of norms) dither identically, so their
    bf16 weights stay equal."""
    a, b = _on_grid(torch.bfloat16), _on_grid(torch.bfloat16)
    dither_main_params(_fake_optimizer([a]), torch.bfloat16)
    dither_main_params(_fake_optimizer([b]), torch.bfloat16)
    assert torch.equal(a, b)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "distributed", [pytest.param(False, marks=pytest.mark.slow), True], ids=["optimizer", "distributed_optimizer"]
)
def test_bf16_engine_weights_follow_their_main_parameters(tiny_model_dir, distributed):
    """A bf16 Megatron engine at DP=2, three Adam steps at lr 1e-5: its bf16 weights move as far
    as its fp32 main parameters (about 1x; round-to-nearest gives a fraction) and stay equal on
    both replicas."""
    model = str(tiny_model_dir("llama"))
    batch = make_batch([20, 14, 17, 9], seed=3)
    world = AllocationMode.from_str("megatron:d2p1t1").train.world_size
    by_rank = run_ranks(
        world,
        "tests.actor.workers:bf16_update_run",
        model_dir=model,
        alloc="d2p1t1",
        batch=batch,
        roundings=["dithered", "nearest"],
        distributed=distributed,
    )
    ratios = {}
    for rounding in ("dithered", "nearest"):
        results = [rank[rounding] for rank in by_rank]
        assert torch.equal(results[0]["weights"], results[1]["weights"]), f"{rounding}: DP replicas diverged"
        owners = results if distributed else results[:1]  # shards of the main parameters, or a whole copy
        mains_moved = sum(r["mains_abs_change"] for r in owners) / sum(r["mains_numel"] for r in owners)
        ratios[rounding] = results[0]["weights_moved"] / mains_moved
    assert 0.85 < ratios["dithered"] < 1.15, ratios
    assert ratios["nearest"] < 0.5, ratios  # the dead zone the dither removes


@pytest.mark.multiproc
def test_recover_point_keeps_the_dithered_main_parameters(tiny_model_dir, tmp_path):
    """A resumed run continues from the saved main parameters, offsets included, not from a new
    draw; main parameters saved by a round-to-nearest run are dithered on load, the model unchanged."""
    model = str(tiny_model_dir("llama"))
    runs = [  # (checkpoint, save it or load it, rounding), one engine after the other in one process
        (str(tmp_path / "dithered"), True, "dithered"),
        (str(tmp_path / "dithered"), False, "dithered"),
        (str(tmp_path / "nearest"), True, "nearest"),
        (str(tmp_path / "nearest"), False, "dithered"),
    ]
    results = run_ranks(
        1, "tests.actor.workers:bf16_main_params_through_checkpoint", model_dir=model, alloc="d1p1t1", runs=runs
    )[0]
    saved, loaded = results[0], results[1]
    assert torch.equal(loaded["mains"], saved["mains"])
    assert torch.equal(loaded["weights"], saved["weights"])
    saved, loaded = results[2], results[3]
    assert torch.equal(loaded["weights"], saved["weights"])
    redithered = (loaded["mains"] != saved["mains"]).float().mean().item()
    assert redithered > 0.9, f"only {redithered:.1%} of the main parameters saved undithered were dithered"
