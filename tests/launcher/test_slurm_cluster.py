"""Submitting to a real one-node Slurm cluster (slurm-wlm) started by the test."""

import pytest

pytestmark = pytest.mark.slurm


def test_sbatch_runs_and_reports_failure(cluster, tmp_path):
    ok = tmp_path / "ok.sh"
    ok.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/ok.out\nsrun hostname\n")
    job = cluster.run("sbatch", "--parsable", str(ok)).stdout.strip()
    assert cluster.wait_job(job, 60) == "COMPLETED", cluster.logs()
    assert (tmp_path / "ok.out").read_text().strip()
    bad = tmp_path / "bad.sh"
    bad.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/bad.out\nsrun false\n")
    job = cluster.run("sbatch", "--parsable", str(bad)).stdout.strip()
    assert cluster.wait_job(job, 60) == "FAILED"
