"""MPI rank discovery: ranks started by a real ``mpiexec`` (MPICH) rendezvous through torch.distributed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.utils.mpi import MPI_LAUNCHER_ENV, TORCH_RANK_ENV, discover_ranks

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")

RANK_SCRIPT = textwrap.dedent("""
    import json, os
    import torch, torch.distributed as dist
    from megarl.utils.mpi import discover_ranks

    assert discover_ranks()
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, {k: os.environ[k] for k in keys})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"sum": total.item(), "ranks": seen}))
    dist.destroy_process_group()
""")


def _clean_env() -> dict[str, str]:
    drop = {*TORCH_RANK_ENV, *MPI_LAUNCHER_ENV, "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'megarl[mpi]')")
def test_mpiexec_ranks_find_each_other_through_torch_distributed():
    pytest.importorskip("mpi4py")
    proc = subprocess.run(
        [MPIEXEC, "-n", "3", sys.executable, "-c", RANK_SCRIPT],
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["sum"] == 1 + 2 + 3
    ranks = result["ranks"]
    assert [r["RANK"] for r in ranks] == ["0", "1", "2"] and {r["WORLD_SIZE"] for r in ranks} == {"3"}
    assert sorted(r["LOCAL_RANK"] for r in ranks) == ["0", "1", "2"] and {r["LOCAL_WORLD_SIZE"] for r in ranks} == {"3"}
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks}) == 1, "one rendezvous point for all ranks"


def test_torchrun_variables_win_and_plain_processes_are_left_alone():
    env = {"RANK": "1", "WORLD_SIZE": "2", "PMI_SIZE": "2"}
    assert not discover_ranks(env) and env == {"RANK": "1", "WORLD_SIZE": "2", "PMI_SIZE": "2"}
    env = {"PATH": "/bin"}
    assert not discover_ranks(env) and env == {"PATH": "/bin"}


def test_mpi_launch_without_mpi4py_names_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"OMPI_COMM_WORLD_SIZE is set.*mpi4py"):
        discover_ranks({"OMPI_COMM_WORLD_SIZE": "2"})
