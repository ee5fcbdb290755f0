"""benchmarks/rollout_anatomy.py: its rows and the derived time per decode step (the server runs are the benchmark's)."""

from __future__ import annotations

import pytest

from benchmarks import rollout_anatomy


def test_rows_derive_the_decode_step_from_the_batch_and_its_first_token():
    times = {name: [(1.0, 64, 64)] for name in rollout_anatomy.VARIANTS}
    times["the job's batch"] = [(2.4, 64, 1000), (2.2, 64, 1024), (2.3, 64, 960)]  # median 2.3 s, 1,000 tokens
    times["first token of the 64"] = [(0.8, 64, 64), (0.9, 64, 64), (0.85, 64, 64)]
    rows = {row["variant"]: row for row in rollout_anatomy._rows(times, gemms=[0.05, 0.04, 0.06])}
    batch = rows["the job's batch"]
    assert (batch["seconds_median"], batch["seconds_min"], batch["seconds_max"]) == (2.3, 2.2, 2.4)
    steps = 1000 / 64 - 1  # tokens per sequence after the first
    assert batch["ms_per_decode_step"] == pytest.approx(1000 * (2.3 - 0.85) / steps)
    assert "ms_per_decode_step" not in rows["no logprobs"]
    assert rows["one decode step's GEMMs alone (torch)"]["ms_per_decode_step"] == pytest.approx(50)


def test_each_variant_changes_one_thing_of_the_jobs_batch():
    job = rollout_anatomy.VARIANTS["the job's batch"]
    assert job == {"requests_per_prompt": rollout_anatomy.SAMPLES}
    for name, variant in rollout_anatomy.VARIANTS.items():
        sequences = variant["requests_per_prompt"] * variant.get("n", 1)
        first_token_of_prompts = name == "first token of the 8 prompts"
        assert sequences == (1 if first_token_of_prompts else rollout_anatomy.SAMPLES), name
