"""Fixtures of the launcher tests."""

import pytest

from tests.launcher.slurm_cluster import SlurmCluster, available


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A real one-node Slurm cluster (slurm-wlm) for the module's tests; they skip where it cannot start."""
    why = available()
    if why:
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()
