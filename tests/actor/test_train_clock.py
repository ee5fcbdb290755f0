"""The train step's parts on a CPU (``MegatronEngine.train_clock``): what ``timeperf/train_step/*`` reports."""

from __future__ import annotations

import pytest

from megarl.run.throughput import record_train_parts
from megarl.utils import stats_tracker
from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_batch

pytestmark = pytest.mark.multiproc


def test_a_real_train_step_is_split_into_forward_backward_and_optimizer(tiny_model_dir):
    """A Megatron step of a tiny model: forward (model, head and loss) inside Megatron's pass, the
    optimizer after it, together within the step's wall time; each part took time."""
    model_dir = str(tiny_model_dir("llama"))
    (out,) = run_ranks(
        1, "tests.actor.workers:train_clock_parts", model_dir=model_dir, alloc="d1p1t1", batch=make_batch([7, 12, 5, 9])
    )
    parts, wall = out["parts"], out["wall"]
    assert set(parts) == {"forward", "schedule", "optimizer"}, parts
    assert 0 < parts["forward"] < parts["schedule"], parts  # the pass holds the forward and the backward
    assert parts["optimizer"] > 0 and parts["schedule"] + parts["optimizer"] <= wall, (parts, wall)


def test_the_parts_are_recorded_under_the_train_steps_timing():
    stats_tracker.export(reset=True)
    parts = record_train_parts({"forward": 1.0, "schedule": 3.0, "optimizer": 0.5}, seconds=4.0)
    assert parts == {"forward": 1.0, "backward": 2.0, "optimizer": 0.5, "other": 0.5}
    stats = stats_tracker.export(reset=True)
    assert {k: stats[k] for k in stats if k.startswith("timeperf/train_step/")} == {
        f"timeperf/train_step/{k}": v for k, v in parts.items()
    }
    assert record_train_parts({}, seconds=4.0) == {}  # a GPU's clock records nothing
