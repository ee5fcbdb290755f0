"""The train–inference gap on the trained tokens (``megarl.actor.gap``): a real Megatron actor's
PPO step whose behaviour logprobs are its own plus known offsets must report exactly those offsets,
split by version lag and by server, with an exact p99 over data-parallel ranks."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.actor.gap import LAG_0_KEY, gap_warning
from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_batch

LENGTHS = [9, 12, 7, 10, 11, 8, 12, 9]


def _offsets(delta: float) -> torch.Tensor:
    """delta x (1/4, 2/4, 3/4, 1) by position, so the gap has a spread (and a p99) to check."""
    width = max(LENGTHS)
    return delta * (torch.arange(width) % 4 + 1).float().div(4).expand(len(LENGTHS), width).clone()


def _expected(batch: dict, offsets: torch.Tensor, rows=None) -> torch.Tensor:
    mask = batch["loss_mask"].bool()
    if rows is not None:
        mask = mask & torch.tensor([r in rows for r in range(len(LENGTHS))])[:, None]
    return offsets[mask].double()


def _p99(values: torch.Tensor) -> float:
    return float(values.sort().values[math.ceil(0.99 * values.numel()) - 1])


@pytest.fixture(scope="module")
def batch():
    b = make_batch(LENGTHS, seed=5)
    b["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])  # no group of 2 is uniform
    return b


@pytest.mark.multiproc
def test_equal_weights_no_gap_and_no_warning(tiny_model_dir, batch):
    stats = run_ranks(
        1,
        "tests.actor.workers:gap_step",
        model_dir=str(tiny_model_dir("llama")),
        alloc="d1p1t1",
        batch=batch,
        offsets=_offsets(0.0),
    )[0]
    assert stats["ppo_actor/gap/abs_logp_diff/max"] < 1e-4
    assert stats["ppo_actor/gap/n_tokens"] == batch["loss_mask"].sum()
    assert gap_warning(stats, 0.1) is None


@pytest.mark.multiproc
@pytest.mark.parametrize("alloc", ["d1p1t1", "d2p1t1"])
def test_offsets_reported_exactly_by_lag_and_server(tiny_model_dir, batch, alloc):
    delta = 0.4
    offsets = _offsets(delta)
    world = 2 if alloc.startswith("d2") else 1
    stats = run_ranks(
        world,
        "tests.actor.workers:gap_step",
        model_dir=str(tiny_model_dir("llama")),
        alloc=alloc,
        batch=batch,
        offsets=offsets,
    )[0]
    every = _expected(batch, offsets)
    assert stats["ppo_actor/gap/abs_logp_diff/avg"] == pytest.approx(float(every.mean()), abs=1e-4)
    assert stats["ppo_actor/gap/abs_logp_diff/max"] == pytest.approx(delta, abs=1e-4)
    assert stats["ppo_actor/gap/abs_logp_diff/p99"] == pytest.approx(_p99(every), abs=1e-4)
    lag0, lag1 = [r for r in range(8) if r % 2 == 0], [r for r in range(8) if r % 2 == 1]
    server0, server1 = [r for r in range(8) if (r // 2) % 2 == 0], [r for r in range(8) if (r // 2) % 2 == 1]
    for key, rows in (("lag_0", lag0), ("lag_1", lag1), ("server_0", server0), ("server_1", server1)):
        expected = _expected(batch, offsets, rows)
        assert stats[f"ppo_actor/gap/{key}/abs_logp_diff/avg"] == pytest.approx(float(expected.mean()), abs=1e-4)
        assert stats[f"ppo_actor/gap/{key}/n_tokens"] == expected.numel()
    message = gap_warning(stats, 0.1)
    assert message is not None and f"{stats[LAG_0_KEY]:.4g}" in message and "gap_threshold=0.1" in message
    assert gap_warning(stats, 1.0) is None


def test_warning_needs_lag_zero_tokens():
    """Tokens of older versions differ by the policy's own change: they alone never warn."""
    assert gap_warning({"ppo_actor/gap/lag_1/abs_logp_diff/avg": 5.0}, 0.1) is None
