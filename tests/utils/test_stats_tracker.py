"""stats_tracker: hand-computed aggregates, scopes, timing, reset, errors, 2-rank gloo reduction."""

import asyncio
import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.utils import stats_tracker
from megarl.utils.network import find_free_port
from megarl.utils.stats_tracker import DistributedStatsTracker, ReduceType


@pytest.fixture
def tracker():
    return DistributedStatsTracker()


def test_walkthrough_correct_incorrect_denominators(tracker):
    rewards = torch.tensor([1.0, 0.0, 1.0, -1.0, 1.0])
    seqlens = torch.tensor([10, 20, 30, 40, 50])
    tracker.denominator(correct_seqs=rewards > 0, incorrect_seqs=rewards <= 0)
    tracker.stat(correct_seq_len=seqlens.float(), denominator="correct_seqs")
    tracker.stat(incorrect_seq_len=seqlens.float(), denominator="incorrect_seqs")
    assert tracker.export() == {
        "correct_seqs": 3.0,
        "incorrect_seqs": 2.0,
        "correct_seq_len/avg": 30.0,  # (10 + 30 + 50) / 3
        "correct_seq_len/min": 10.0,
        "correct_seq_len/max": 50.0,
        "incorrect_seq_len/avg": 30.0,  # (20 + 40) / 2
        "incorrect_seq_len/min": 20.0,
        "incorrect_seq_len/max": 40.0,
    }


def test_stats_accumulate_over_calls_as_one_global_mean(tracker):
    # Two batches of different sizes: the mean is over elements, not over batch means.
    tracker.denominator(n=torch.tensor([True, True, False]))
    tracker.stat(x=torch.tensor([1.0, 2.0, 100.0]), denominator="n")
    tracker.denominator(n=torch.tensor([True]))
    tracker.stat(x=torch.tensor([9.0]), denominator="n")  # pairs with the latest mask
    out = tracker.export()
    assert out == {"n": 3.0, "x/avg": 4.0, "x/min": 1.0, "x/max": 9.0}


@pytest.mark.parametrize("with_nan", [False, True])
def test_small_host_records_agree_with_the_tensor_path(tracker, with_nan):
    """A few host numbers are folded in with Python (the rollout loop records some per episode); mixed
    with large records of the same key, the export is the plain torch aggregate of all of them."""
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, generator=gen, dtype=torch.float64) for n in (1, 3, 500, 2, 64, 65, 1)]
    masks = [torch.rand(len(c), generator=gen) < 0.7 for c in chunks]
    masks[0][:] = True
    if with_nan:
        chunks[3][0], masks[3][0] = float("nan"), True
    for chunk, mask in zip(chunks, masks):
        tracker.denominator(n=mask)
        tracker.stat(x=chunk, denominator="n")
    out = tracker.export()
    picked = torch.cat([c[m] for c, m in zip(chunks, masks)])
    assert out["n"] == picked.numel()
    if with_nan:
        assert all(out[f"x/{k}"] != out[f"x/{k}"] for k in ("avg", "min", "max")), out
        return
    assert out["x/avg"] == pytest.approx(picked.mean().item(), rel=1e-12)
    assert (out["x/min"], out["x/max"]) == (picked.min().item(), picked.max().item())


@pytest.mark.parametrize(
    "reduce_type, expected",
    [
        (ReduceType.AVG, {"x": 5 / 3}),  # masked elements: -1, 0, 6
        (ReduceType.SUM, {"x": 5.0}),
        (ReduceType.MIN, {"x": -1.0}),
        (ReduceType.MAX, {"x": 6.0}),
    ],
)
def test_reduce_types(tracker, reduce_type, expected):
    tracker.denominator(m=torch.tensor([[True, False], [True, True]]))
    x = torch.tensor([[-1.0, 50.0], [0.0, 6.0]])
    tracker.stat(x=x, denominator="m", reduce_type=reduce_type)
    out = tracker.export()
    del out["m"]
    assert out == pytest.approx(expected)


def test_empty_denominator_leaves_means_out(tracker):
    tracker.denominator(m=torch.zeros(3, dtype=torch.bool))
    tracker.stat(x=torch.ones(3), denominator="m")
    assert tracker.export() == {"m": 0.0}


def test_scalar_is_mean_over_calls_and_accepts_tensors(tracker):
    tracker.scalar(loss=1.0, lr=1e-4)
    tracker.scalar(loss=torch.tensor(5.0))
    assert tracker.export() == pytest.approx({"loss": 3.0, "lr": 1e-4})


def test_scopes_nest_and_apply_to_denominators(tracker):
    with tracker.scope("actor"):
        tracker.scalar(loss=0.25)
        with tracker.scope("optimizer"):
            tracker.scalar(lr=1e-4)
        tracker.denominator(valid=torch.tensor([True, False]))
        ratio = torch.tensor([2.0, 3.0])
        tracker.stat(ratio=ratio, denominator="valid", reduce_type=ReduceType.AVG)
    tracker.scalar(top=1.0)
    assert tracker.export() == pytest.approx(
        {
            "actor/loss": 0.25,
            "actor/optimizer/lr": 1e-4,
            "actor/valid": 1.0,
            "actor/ratio": 2.0,
            "top": 1.0,
        }
    )


def test_scope_func_wrapper_and_exceptions_restore_scope(tracker):
    @tracker.scope_func_wrapper("A")
    def inner(v):
        """doc kept"""
        tracker.scalar(v=v)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        inner(2.0)
    tracker.scalar(after=1.0)
    assert inner.__doc__ == "doc kept"
    assert tracker.export() == {"A/v": 2.0, "after": 1.0}


def test_scopes_are_per_asyncio_task(tracker):
    async def episode(name, value):
        with tracker.scope(name):
            await asyncio.sleep(0.01)  # interleave with the other task
            tracker.scalar(reward=value)

    async def main():
        await asyncio.gather(episode("a", 1.0), episode("b", 2.0))

    asyncio.run(main())
    assert tracker.export() == {"a/reward": 1.0, "b/reward": 2.0}


def test_record_timing_keys_and_duration(tracker):
    with tracker.record_timing("train_step"):
        time.sleep(0.02)
    with tracker.scope("actor"), tracker.record_timing("update"):
        pass
    with tracker.record_timing("train_step"):
        time.sleep(0.02)
    out = tracker.export()
    assert set(out) == {"timeperf/train_step", "timeperf/actor/update"}
    assert 0.02 <= out["timeperf/train_step"] < 1.0  # mean of the two calls
    assert out["timeperf/actor/update"] < out["timeperf/train_step"]


def test_reset_semantics(tracker):
    tracker.scalar(a=1.0, b=2.0)
    assert tracker.export(reset=False) == {"a": 1.0, "b": 2.0}
    tracker.scalar(a=3.0)
    assert tracker.export(key="a") == {"a": 2.0}  # only "a" is exported and dropped
    assert tracker.export() == {"b": 2.0}
    assert tracker.export() == {}
    tracker.scalar(a=7.0)  # a fresh start after reset
    assert tracker.export() == {"a": 7.0}


def test_key_export_resolves_scope(tracker):
    with tracker.scope("actor"):
        tracker.scalar(loss=1.0)
        assert tracker.export(key="loss") == {"actor/loss": 1.0}


def test_denominator_is_needed_again_after_reset(tracker):
    tracker.denominator(m=torch.tensor([True]))
    tracker.export()
    with pytest.raises(ValueError, match="denominator 'm' was not recorded"):
        tracker.stat(x=torch.tensor([1.0]), denominator="m")


def test_error_messages(tracker):
    with pytest.raises(ValueError, match=r"stat 'actor/x': denominator 'actor/missing'"):
        with tracker.scope("actor"):
            tracker.stat(x=torch.ones(2), denominator="missing")
    tracker.denominator(m=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"'x' has shape \(3, 2\).*'m' has shape \(2, 3\)"):
        tracker.stat(x=torch.ones(3, 2), denominator="m")
    with pytest.raises(ValueError, match="'d' must be a bool tensor, got torch.float32"):
        tracker.denominator(d=torch.ones(2))
    with pytest.raises(ValueError, match="'y' must be a real-valued tensor"):
        tracker.stat(y=[1.0, 2.0], denominator="m")
    with pytest.raises(ValueError, match="reduce_type"):
        tracker.stat(x=torch.ones(2, 3), denominator="m", reduce_type=ReduceType.SCALAR)
    with pytest.raises(ValueError, match="scalar 'v' needs one element"):
        tracker.scalar(v=torch.ones(2))
    tracker.scalar(k=1.0)
    with pytest.raises(ValueError, match="'k' was recorded as .SCALAR"):
        tracker.stat(k=torch.ones(2, 3), denominator="m")


def test_named_trackers_and_module_api():
    stats_tracker.export_all()  # start clean whatever ran before
    assert stats_tracker.get("rollout") is stats_tracker.get("rollout")
    stats_tracker.get("rollout").scalar(reward=1.0)
    stats_tracker.scalar(loss=2.0)
    with stats_tracker.scope("s"):
        stats_tracker.denominator(m=torch.tensor([True, True]))
        stats_tracker.stat(v=torch.tensor([1.0, 3.0]), denominator="m", reduce_type=ReduceType.AVG)
    expected = {"rollout/reward": 1.0, "loss": 2.0, "s/m": 2.0, "s/v": 2.0}
    assert stats_tracker.export_all() == expected
    assert stats_tracker.export_all() == {}


# ------------------------------------------------------------------ two ranks over gloo


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tracker = DistributedStatsTracker()
        if rank == 0:
            tracker.denominator(m=torch.tensor([True, True, False]))
            tracker.stat(x=torch.tensor([1.0, 2.0, 1000.0]), denominator="m")
            tracker.scalar(loss=1.0)
            tracker.scalar(loss=3.0)
        else:
            tracker.denominator(m=torch.tensor([True, False, True, True]))
            tracker.stat(x=torch.tensor([10.0, -500.0, -4.0, 8.0]), denominator="m")
            tracker.scalar(loss=8.0, only_rank1=5.0)  # a key rank 0 never recorded
        result = {"all": tracker.export(reset=False), "local": tracker.export(local=True)}
        stats_tracker.get("named").scalar(v=float(rank))
        result["export_all"] = stats_tracker.export_all()
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_two_rank_export_is_exact_global(tmp_path):
    mp.spawn(_two_rank_worker, args=(find_free_port(), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = {
        "m": 5.0,
        "x/avg": (1 + 2 + 10 - 4 + 8) / 5,
        "x/min": -4.0,
        "x/max": 10.0,
        "loss": (1 + 3 + 8) / 3,  # weighted by each rank's number of calls
        "only_rank1": 5.0,
    }
    for rank, result in enumerate(results):
        assert result["all"] == pytest.approx(expected), rank
        assert result["export_all"] == pytest.approx({"named/v": 0.5}), rank
    local0 = {"m": 2.0, "x/avg": 1.5, "x/min": 1.0, "x/max": 2.0, "loss": 2.0}
    assert results[0]["local"] == pytest.approx(local0)
    assert results[1]["local"]["x/avg"] == pytest.approx(14 / 3)
