"""Megatron distributed checkpoints: saved at one data- (or context-) parallel size, resumed at another.

Two bf16 steps (distributed optimizer, clipping, warmup + cosine LR) at DP2, save, then two
more steps; a fresh DP1 engine that loads the checkpoint must reproduce both next losses
(the first checks the weights, the second the Adam state and LR schedule), the LR and the
version.
"""

from __future__ import annotations

import pytest

from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_batch

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize(
    "save_alloc,load_alloc",
    [
        ("d2p1t1", "d1p1t1"),
        pytest.param("d1p1t1", "d2p1t1", marks=pytest.mark.slow),
        ("d1p1t1c2", "d1p1t1"),  # the distributed optimizer's shards over data x context parallel
    ],
)
def test_checkpoint_resumes_at_another_dp_size(tiny_model_dir, tmp_path, save_alloc, load_alloc):
    model_dir = str(tiny_model_dir("llama"))
    batches = [make_batch([7, 12, 5, 9], seed=s) for s in range(3)]
    common = {"model_dir": model_dir, "batches": batches, "ckpt_dir": str(tmp_path / "ckpt"), "dtype": "bfloat16"}
    world = {"d1p1t1": 1, "d2p1t1": 2, "d1p1t1c2": 2}
    saved = run_ranks(world[save_alloc], "tests.actor.workers:checkpoint_save_then_train", alloc=save_alloc, **common)
    resumed = run_ranks(world[load_alloc], "tests.actor.workers:checkpoint_load_then_train", alloc=load_alloc, **common)
    want, got = saved[0], resumed[0]
    assert got["version"] == 2 and got["lr"] == want["lr"]
    assert got["losses"][0] == pytest.approx(want["losses"][0], rel=1e-6)  # same weights
    assert got["losses"][1] == pytest.approx(want["losses"][1], rel=1e-4)  # same optimizer state
