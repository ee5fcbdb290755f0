"""A trainer rank's heartbeat says where it is inside a phase (the micro-batch of the schedule) and
which collective it is in, on a real Megatron actor."""

from __future__ import annotations

import pytest

from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_grouped_batch


@pytest.mark.multiproc
@pytest.mark.parametrize("alloc, world", [("d1p1t1", 1), ("d1p2t1", 2)])
def test_micro_batches_and_collectives_reach_the_heartbeat(tiny_model_dir, tmp_path, alloc, world):
    batch = make_grouped_batch(4, 2, prompt_len=5, seed=3)
    outs = run_ranks(
        world,
        "tests.actor.workers:heartbeat_steps",
        model_dir=str(tiny_model_dir("llama")),
        alloc=alloc,
        batch=batch,
        run_dir=str(tmp_path),
    )
    for out in outs:
        # compute_logp's forward-only pass, then the update's forward-backward, 2 micro-batches each
        assert out["steps"][:2] == ["micro-batch forward 1 of 2", "micro-batch forward 2 of 2"], out["steps"]
        assert "micro-batch forward-backward 2 of 2" in out["steps"], out["steps"]
        assert "all_reduce" in out["ops"], out["ops"]  # e.g. the loss weight and grad norm over the ranks
        assert out["wrapped"] and out["restored"], "wrapped while the heartbeat runs, restored when it stops"
