"""Rank discovery on MPI clusters: ``mpirun -np N python -m megarl.train --config run.yaml``.

torch.distributed's ``env://`` rendezvous reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``, and megarl picks its device from ``LOCAL_RANK``. torchrun (local
launcher) and srun + torchrun (Slurm launcher) set them; ``mpirun`` does not. When they
are missing and the process was started by an MPI launcher, :func:`discover_ranks` fills
them in from MPI (``mpi4py``, an optional dependency):

- rank and world size from ``COMM_WORLD``;
- the local rank and local world size from a shared-memory split (ranks on one node);
- rank 0's address and a free port on it, broadcast to every rank.

The inference servers are started separately (``megarl serve`` per server, or any
OpenAI-compatible vLLM / SGLang server); the trainer finds them through
``rollout.server_addrs`` or the ``MEGARL_LLM_SERVER_ADDRS`` environment variable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from megarl.utils.network import find_free_port, gethostip

logger = logging.getLogger(__name__)

MPI_LAUNCHER_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")
"""Variables an MPI launcher sets in every rank (Open MPI, MPICH / Intel MPI (PMI), PMIx, MVAPICH2)."""
TORCH_RANK_ENV = ("RANK", "WORLD_SIZE")


def started_by_mpi(env: MutableMapping[str, str] = os.environ) -> bool:
    """True when an MPI launcher started this process."""
    return any(name in env for name in MPI_LAUNCHER_ENV)


def discover_ranks(env: MutableMapping[str, str] = os.environ) -> bool:
    """Set torch.distributed's rank variables from MPI when a launcher like ``mpirun`` left them unset.

    Returns True when it set them; False when they were already set (torchrun, srun) or
    the process was not started by MPI. Collective over the MPI ranks.
    """
    if all(name in env for name in TORCH_RANK_ENV) or not started_by_mpi(env):
        return False
    try:
        from mpi4py import MPI
    except ImportError as e:
        launcher = next(name for name in MPI_LAUNCHER_ENV if name in env)
        raise RuntimeError(
            f"this process was started by an MPI launcher ({launcher} is set) without RANK / WORLD_SIZE; "
            "rank discovery through MPI needs mpi4py (pip install 'megarl[mpi]'), or launch with torchrun"
        ) from e
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    master = None
    if comm.Get_rank() == 0:  # the rendezvous point: this host, a free port (unless the user set them)
        master = (env.get("MASTER_ADDR") or gethostip(), int(env.get("MASTER_PORT") or find_free_port("0.0.0.0")))
    master_addr, master_port = comm.bcast(master, root=0)
    env.update(
        RANK=str(comm.Get_rank()),
        WORLD_SIZE=str(comm.Get_size()),
        LOCAL_RANK=str(local.Get_rank()),
        LOCAL_WORLD_SIZE=str(local.Get_size()),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    logger.info(
        "MPI rank %s/%s (local %s/%s); rendezvous at %s:%s",
        env["RANK"],
        env["WORLD_SIZE"],
        env["LOCAL_RANK"],
        env["LOCAL_WORLD_SIZE"],
        master_addr,
        master_port,
    )
    return True
