"""``benchmarks/async_sim.py`` at tiny size: the planner's rates turned into a simulated slice, and one
staleness bound driven through megarl's pool, coordinator and weight sync (one server, one warm-up and
one measured step, every time scaled by 0.1: about 40 s, most of it starting the processes)."""

from __future__ import annotations

import pytest

from benchmarks import async_sim


def test_the_simulated_servers_are_fitted_to_the_planners_rates():
    """5,000 tokens/s at the workload's 64 requests a server, a capped mean answer of the planner's 300
    tokens, and the planner's steps: 22.6 s synchronous (the longest of 1,024 tokens at 10 ms a token),
    12.4 s at max_staleness 1 and more."""
    serving = async_sim.serving_model()
    assert async_sim.per_server() == 64
    assert serving.throughput(64) == pytest.approx(5000.0)
    assert async_sim.capped_mean(serving.mean_tokens, serving.sigma, 1024) == pytest.approx(300.0, rel=1e-6)
    assert async_sim.planner_step(0) == pytest.approx(22.6, abs=0.05)
    assert async_sim.planner_step(1) == async_sim.planner_step(4) == pytest.approx(12.4, abs=0.05)
    quick = async_sim.serving_model(0.1)
    assert quick.throughput(64) == pytest.approx(50000.0) and quick.ttft_s == pytest.approx(serving.ttft_s / 10)


def test_one_bound_runs_through_megarls_pool_and_keeps_its_staleness():
    """max_staleness 1: every consumed trajectory started under the trainer's version or the one before,
    a step's 64 episodes are all there, and the shares are shares."""
    row = async_sim._in_own_process(1, 1, 1, 1, 0.1)
    assert row["episodes/step"] == 64 and row["steps (warm-up + measured)"] == "1 + 1", row
    hist = dict(tuple(map(int, pair.split(":"))) for pair in row["staleness hist"].split())
    assert set(hist) <= {0, 1} and sum(hist.values()) == 64, row
    for key in ("inference idle", "servers paused", "trainer idle", "tokens / rated"):
        assert 0.0 <= row[key] <= 1.0, (key, row)
    assert row["step s"] > 0 and row["steps/hour"] == pytest.approx(3600 / row["step s"]), row
    assert row["planner step s"] == pytest.approx(12.4, abs=0.05), row
