"""Megatron distributed checkpoints: saved at one parallel layout, resumed at another.

Two steps (distributed optimizer, clipping, warmup + cosine LR) at one layout, save (the optimizer's
state as per-rank shards, the default, or per parameter: ``optimizer.checkpoint_layout: any``), then two more
steps; a fresh engine at another layout loads the checkpoint. Right after the load its main
parameters and Adam moments, read from the optimizer's live buffers and gathered into whole HF
tensors, must equal the saver's bit for bit; then it must reproduce both next losses (the first
checks the weights, the second the Adam state and LR schedule), the LR and the version.
"""

from __future__ import annotations

import pytest
import torch

from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_batch

pytestmark = pytest.mark.multiproc

WORLD = {"d1p1t1": 1, "d2p1t1": 2, "d1p1t1c2": 2, "d1p1t2": 2, "d1p2t1": 2, "d1p2t1v2": 2, "d2p1t1e2": 2}


def save_then_load(model_dir, tmp_path, save_alloc, load_alloc, dtype, checkpoint_layout="data_parallel"):
    batches = [make_batch([7, 12, 5, 9], seed=s) for s in range(3)]
    common = {
        "model_dir": str(model_dir),
        "batches": batches,
        "ckpt_dir": str(tmp_path / "ckpt"),
        "dtype": dtype,
        "checkpoint_layout": checkpoint_layout,
    }
    saved = run_ranks(WORLD[save_alloc], "tests.actor.workers:checkpoint_save_then_train", alloc=save_alloc, **common)
    resumed = run_ranks(WORLD[load_alloc], "tests.actor.workers:checkpoint_load_then_train", alloc=load_alloc, **common)
    return saved[0], resumed[0]


def assert_resumed(want: dict, got: dict, first_rel: float, second_rel: float) -> None:
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert sorted(got["state"][key]) == sorted(want["state"][key])
        for name, tensor in want["state"][key].items():
            assert torch.equal(got["state"][key][name], tensor), (key, name)
    assert any(t.abs().sum() > 0 for t in want["state"]["exp_avg"].values())
    assert got["version"] == 2 and got["lr"] == want["lr"]
    assert got["losses"][0] == pytest.approx(want["losses"][0], rel=first_rel)  # same weights
    assert got["losses"][1] == pytest.approx(want["losses"][1], rel=second_rel)  # same optimizer state


@pytest.mark.parametrize(
    "save_alloc,load_alloc",
    [
        ("d2p1t1", "d1p1t1"),
        pytest.param("d1p1t1", "d2p1t1", marks=pytest.mark.slow),
        ("d1p1t1c2", "d1p1t1"),  # the distributed optimizer's shards over data x context parallel
    ],
)
def test_checkpoint_resumes_at_another_dp_size(tiny_model_dir, tmp_path, save_alloc, load_alloc):
    """The default per-rank shards; bf16 weights: the losses to bf16's rounding of the same computation
    split otherwise."""
    want, got = save_then_load(tiny_model_dir("llama"), tmp_path, save_alloc, load_alloc, "bfloat16")
    assert_resumed(want, got, first_rel=1e-6, second_rel=1e-4)


@pytest.mark.parametrize(
    "save_alloc,load_alloc",
    [
        ("d1p1t2", "d2p1t1"),  # tensor- into data-parallel: every TP-split weight and moment gathered
        ("d2p1t1", "d1p2t1"),  # data- into pipeline-parallel: each stage takes its layers' state
        pytest.param("d1p2t1v2", "d1p1t2", marks=pytest.mark.slow),  # virtual pipeline chunks into TP
    ],
)
def test_checkpoint_resumes_at_another_model_parallel_layout(tiny_model_dir, tmp_path, save_alloc, load_alloc):
    """fp32: the resumed losses differ from the saver's by the summation order of another split only
    (a relative error of a few float32 epsilons per reduction, far below 1e-5)."""
    want, got = save_then_load(tiny_model_dir("llama"), tmp_path, save_alloc, load_alloc, "float32", "any")
    assert_resumed(want, got, first_rel=1e-5, second_rel=1e-5)


@pytest.mark.parametrize(
    "save_alloc,load_alloc", [("d2p1t1", "d2p1t1e2"), pytest.param("d2p1t1e2", "d2p1t1", marks=pytest.mark.slow)]
)
def test_an_moe_checkpoint_resumes_at_another_expert_parallel_size(tiny_model_dir, tmp_path, save_alloc, load_alloc):
    """Expert-parallel ranks hold different experts and their optimizer state (a second optimizer, over the
    expert data-parallel group); at EP 1 one rank holds them all, in one optimizer."""
    want, got = save_then_load(tiny_model_dir("qwen3_moe"), tmp_path, save_alloc, load_alloc, "float32", "any")
    assert_resumed(want, got, first_rel=1e-5, second_rel=1e-5)


def test_per_rank_optimizer_shards_at_another_model_parallel_layout_are_refused_by_name(tiny_model_dir, tmp_path):
    """``checkpoint_layout: data_parallel`` (the default) writes each rank's buckets as they are: another
    TP size is refused before anything loads, naming the setting that would have made it loadable."""
    with pytest.raises(
        RuntimeError,
        match=r"optimizer.checkpoint_layout=data_parallel.*layout differs \(tp 2 -> 1\).*checkpoint_layout=any",
    ):
        save_then_load(tiny_model_dir("llama"), tmp_path, "d1p1t2", "d2p1t1", "float32", "data_parallel")


def test_a_checkpoint_of_another_model_is_refused_by_name(tiny_model_dir, tmp_path):
    """A run resumed with another actor.path (here a wider MLP) gets the model's difference named, not
    Megatron's shape mismatch of one tensor."""
    batches = [make_batch([7, 12, 5, 9], seed=s) for s in range(3)]
    common = {"batches": batches, "ckpt_dir": str(tmp_path / "ckpt"), "alloc": "d1p1t1"}
    save, load = "tests.actor.workers:checkpoint_save_then_train", "tests.actor.workers:checkpoint_load_then_train"
    run_ranks(1, save, model_dir=str(tiny_model_dir("llama")), **common)
    wider = tiny_model_dir("llama", intermediate_size=96)
    with pytest.raises(RuntimeError, match=r"holds another model than this engine's \(intermediate_size \d+ -> 96\)"):
        run_ranks(1, load, model_dir=str(wider), **common)
