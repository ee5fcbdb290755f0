"""AReaL's GSM8K walkthrough loop, ported to megarl's public names, trains against a real vLLM server.

The loop is the walkthrough's own (``tests/run/areal_walkthrough.py``): ``actor.connect_engine(rollout,
meta)``, ``actor.prepare_batch``, ``compute_logp``, ``compute_advantages``, ``ppo_update``,
``step_lr_scheduler``, ``rollout.pause()``, ``actor.update_weights(meta)``, ``actor.set_version``,
``rollout.set_version``, ``rollout.resume()``.
"""

from __future__ import annotations

import math

import pytest

from tests.actor.dist_utils import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

PROBE_TOLERANCE = 0.05  # max |dlogp| of the trainer vs the server on the probe (bf16 on both where native)


def test_the_walkthrough_loop_trains_and_updates_a_vllm_server(vllm_server, vllm_model_dir):
    (out,) = run_ranks(
        1,
        "tests.run.areal_walkthrough:walkthrough",
        timeout=900,
        model_dir=str(vllm_model_dir),
        address=vllm_server.address,
        steps=2,
    )
    first, second = out["steps"]
    for step in (first, second):
        assert step["rows"] == 4  # two prompts, two samples each
        assert step["logp_finite"] and step["loss"] and all(math.isfinite(x) for x in step["loss"])
        assert step["probe_max"] is not None and step["probe_max"] < PROBE_TOLERANCE, step
    # max_staleness 0: the first batch comes from the first weights, the second from the first update's
    assert first["versions"] == [0] and second["versions"] == [1]
    assert out["actor_version"] == out["rollout_version"] == 2
