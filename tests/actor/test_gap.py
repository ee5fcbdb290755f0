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
from tests.numerics import assert_within, gamma, softmax_head_bounds, unit_roundoff

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


def recorded_gap_step(model_dir: str, alloc: str, batch: dict, offsets: torch.Tensor) -> dict:
    """``tests.actor.workers.gap_step`` (one rank's), also returning for every token whose gap it records
    the behaviour logprob and the float32 error bound of the trainer's logprob there, from the hidden
    states and the LM head of the update's forward (``tests/numerics.py`` softmax_head_bounds)."""
    from megarl.actor import ppo_loss
    from tests.actor.workers import gap_step

    recorded = []
    loss_of_logprobs = ppo_loss._loss_of_logprobs

    def recording(head, mb, cfg, norm_len, mask, logp, entropy, surrogate_fn, gap, *rest):
        if gap is not None:  # the gap meter: this micro-batch's gap is recorded
            assert ppo_loss.replayed_truncation(cfg) is None and head.vocab_start == 0, "a full softmax on one rank"
            rows = mask.nonzero().squeeze(-1)
            hidden, weight = head.hidden.detach()[rows], head.weight.detach()[: head.vocab_size]
            coefs = torch.zeros(2, rows.numel())
            bound = softmax_head_bounds(hidden, weight, mb["labels"][rows], coefs, cfg.temperature, torch.float32)
            recorded.append(torch.stack([mb["behaviour_logp"][rows].double(), bound.logprob]))
        return loss_of_logprobs(head, mb, cfg, norm_len, mask, logp, entropy, surrogate_fn, gap, *rest)

    ppo_loss._loss_of_logprobs = recording
    stats = gap_step(model_dir, alloc, batch, offsets)
    return {"stats": stats, "tokens": torch.cat(recorded, dim=1)}


def _gap_bound(results: list, offsets: torch.Tensor) -> float:
    """The largest error of one token's reported gap |trainer - behaviour| against its offset, in float32.

    The behaviour logprob is the trainer's from ``compute_logp`` plus the offset, rounded: within u |b|.
    The update's forward gives the trainer's logprob anew: the model's layers run the same operations on
    the same packed micro-batches (no dropout), so the hidden states are the same, but the LM head runs
    on the loss tokens only, its matrix products on other shapes than ``compute_logp``'s; each of the two
    float32 logprobs is within the head's bound B of the exact one, so they differ by at most 2 B. The
    gap's subtraction then rounds once: u (|offset| + the errors before it)."""
    u = unit_roundoff(torch.float32)
    behaviour, head_bound = torch.cat([r["tokens"] for r in results], dim=1)
    before = 2 * head_bound + u * behaviour.abs()
    return float((before * (1 + u)).max() + u * offsets.abs().max())


def _mean_bound(token_bound: float, expected: torch.Tensor) -> float:
    """A mean of n reported gaps, each within ``token_bound`` of its offset, summed in float64 (and over the
    data-parallel ranks) and divided by n: within token_bound + gamma(n + 1) sum|gap| / n of the offsets' mean."""
    return token_bound + gamma(expected.numel() + 1, torch.float64) * (float(expected.mean()) + token_bound)


def _assert_close(stats: dict, key: str, want: float, bound: float) -> float:
    return assert_within(
        torch.tensor(stats[key], dtype=torch.float64), torch.tensor(want, dtype=torch.float64), bound, key
    )


@pytest.fixture(scope="module")
def batch():
    b = make_batch(LENGTHS, seed=5)
    b["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])  # no group of 2 is uniform
    return b


@pytest.mark.multiproc
def test_equal_weights_no_gap_and_no_warning(tiny_model_dir, batch):
    offsets = _offsets(0.0)
    results = run_ranks(
        1,
        "tests.actor.test_gap:recorded_gap_step",
        model_dir=str(tiny_model_dir("llama")),
        alloc="d1p1t1",
        batch=batch,
        offsets=offsets,
    )
    stats = results[0]["stats"]
    _assert_close(stats, "ppo_actor/gap/abs_logp_diff/max", 0.0, _gap_bound(results, offsets))
    assert stats["ppo_actor/gap/n_tokens"] == batch["loss_mask"].sum()
    assert gap_warning(stats, 0.1) is None


@pytest.mark.multiproc
@pytest.mark.parametrize("alloc", ["d1p1t1", "d2p1t1"])
def test_offsets_reported_exactly_by_lag_and_server(tiny_model_dir, batch, alloc):
    # offsets far above a token's error bound (some 6e-3, mostly the head's sum over a vocabulary of 49152),
    # so that the splits' means, which differ by about 1% of delta, stand apart
    delta = 4.0
    offsets = _offsets(delta)
    world = 2 if alloc.startswith("d2") else 1
    results = run_ranks(
        world,
        "tests.actor.test_gap:recorded_gap_step",
        model_dir=str(tiny_model_dir("llama")),
        alloc=alloc,
        batch=batch,
        offsets=offsets,
    )
    stats = results[0]["stats"]
    token_bound = _gap_bound(results, offsets)
    every = _expected(batch, offsets)
    _assert_close(stats, "ppo_actor/gap/abs_logp_diff/avg", float(every.mean()), _mean_bound(token_bound, every))
    # order statistics of the reported gaps: each within the largest token's error of the offsets' own
    _assert_close(stats, "ppo_actor/gap/abs_logp_diff/max", delta, token_bound)
    _assert_close(stats, "ppo_actor/gap/abs_logp_diff/p99", _p99(every), token_bound)
    lag0, lag1 = [r for r in range(8) if r % 2 == 0], [r for r in range(8) if r % 2 == 1]
    server0, server1 = [r for r in range(8) if (r // 2) % 2 == 0], [r for r in range(8) if (r // 2) % 2 == 1]
    for key, rows in (("lag_0", lag0), ("lag_1", lag1), ("server_0", server0), ("server_1", server1)):
        expected = _expected(batch, offsets, rows)
        mean_key = f"ppo_actor/gap/{key}/abs_logp_diff/avg"
        _assert_close(stats, mean_key, float(expected.mean()), _mean_bound(token_bound, expected))
        assert stats[f"ppo_actor/gap/{key}/n_tokens"] == expected.numel()
    # the bound is not vacuous: a mean 1.01 bounds away fails, 0.99 bounds away passes
    want, bound = float(every.mean()), _mean_bound(token_bound, every)
    with pytest.raises(AssertionError, match="beyond their error bound"):
        _assert_close({"mean": want + 1.01 * bound}, "mean", want, bound)
    _assert_close({"mean": want + 0.99 * bound}, "mean", want, bound)
    message = gap_warning(stats, 0.1)
    assert message is not None and f"{stats[LAG_0_KEY]:.4g}" in message and "gap_threshold=0.1" in message
    assert gap_warning(stats, delta) is None  # every mean gap is below the largest offset


def test_warning_needs_lag_zero_tokens():
    """Tokens of older versions differ by the policy's own change: they alone never warn."""
    assert gap_warning({"ppo_actor/gap/lag_1/abs_logp_diff/avg": 5.0}, 0.1) is None
