"""Parallel initialisation of the Megatron trainer: torch.distributed + megatron parallel_state.

One call, :func:`init_parallel`, turns the training part of an allocation mode
(``megatron:d2p2t2e2``) into process groups and returns a :class:`ParallelState`
that the rest of megarl passes around explicitly. Megatron-Core itself still keeps
its groups in module globals (``megatron.core.parallel_state``); this object reads
them once at the edge so that megarl code never calls the getters itself.

Backends: NCCL on GPU, gloo on CPU (through :mod:`megarl.actor.cpu_shim`).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megarl.actor import cpu_shim
from megarl.config.allocation import TrainingAllocation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelState:
    """Process groups and this rank's coordinates in the trainer layout."""

    alloc: TrainingAllocation
    """The layout (sizes) this state was built from."""
    groups: object
    """Megatron's ``ProcessGroupCollection`` (tp, pp, dp, dp_cp, cp, ep, expt_tp, expt_dp, embd, ...)."""
    rank: int
    """Global rank."""
    world_size: int
    """Number of trainer ranks."""
    tp_rank: int
    pp_rank: int
    dp_rank: int
    """Data-parallel rank: which share of each batch this rank trains on (its context-parallel peers get the same)."""
    cp_rank: int
    """Rank among the context-parallel peers that split each sequence of the share (0 without CP)."""
    replica_rank: int
    """Rank among the copies of this rank's dense weights (data x context parallel; ``dp_rank`` without CP)."""
    ep_rank: int
    etp_rank: int
    edp_rank: int
    """Rank among the replicas of this rank's expert shards (expert data parallel)."""

    @property
    def tp_group(self):
        return self.groups.tp

    @property
    def pp_group(self):
        return self.groups.pp

    @property
    def dp_group(self):
        """Data-parallel group including context parallelism (gradients average over it)."""
        return self.groups.dp_cp

    @property
    def data_group(self):
        """Data-parallel group without context parallelism: one rank per distinct share of the batch."""
        return self.groups.dp

    @property
    def cp_group(self):
        """Context-parallel group: the ranks that split the same sequences."""
        return self.groups.cp

    @property
    def ep_group(self):
        return self.groups.ep

    @property
    def etp_group(self):
        return self.groups.expt_tp

    @property
    def is_pp_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pp_last(self) -> bool:
        return self.pp_rank == self.alloc.pp - 1

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        return dist.get_process_group_ranks(self.pp_group)[-1]

    @property
    def is_dp_head(self) -> bool:
        """One rank per model replica that speaks for it (TP 0, PP last, DP 0 is not implied)."""
        return self.tp_rank == 0 and self.is_pp_last


def default_backend() -> str:
    """NCCL with CUDA, gloo without."""
    return "nccl" if cpu_shim.cuda_available() else "gloo"


def init_parallel(alloc: TrainingAllocation, *, seed: int = 1, timeout_minutes: int = 30) -> ParallelState:
    """Initialise torch.distributed (from the torchrun env vars) and Megatron's groups.

    Idempotent for torch.distributed (an existing default group is reused, its world
    size must match ``alloc.world_size``). Megatron's model-parallel state is
    (re)built for ``alloc``.
    """
    cpu_shim.install()
    _init_torch_distributed(alloc, timeout_minutes)
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=alloc.tp,
        pipeline_model_parallel_size=alloc.pp,
        virtual_pipeline_model_parallel_size=alloc.vpp if alloc.vpp > 1 else None,
        context_parallel_size=alloc.cp,
        expert_model_parallel_size=alloc.ep,
        expert_tensor_parallel_size=alloc.expert_tp,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=True,
    )
    state = _read_state(alloc)
    seed_everything(seed, state)
    logger.info(
        "rank %d/%d: tp %d/%d pp %d/%d dp %d/%d cp %d/%d ep %d/%d etp %d/%d",
        state.rank,
        state.world_size,
        state.tp_rank,
        alloc.tp,
        state.pp_rank,
        alloc.pp,
        state.dp_rank,
        alloc.dp,
        state.cp_rank,
        alloc.cp,
        state.ep_rank,
        alloc.ep,
        state.etp_rank,
        alloc.expert_tp,
    )
    return state


def _init_torch_distributed(alloc: TrainingAllocation, timeout_minutes: int) -> None:
    if not dist.is_initialized():
        backend = default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    if dist.get_world_size() != alloc.world_size:
        raise ValueError(
            f"allocation '{alloc}' needs {alloc.world_size} trainer ranks, "
            f"but torch.distributed has world size {dist.get_world_size()}"
        )


def _read_state(alloc: TrainingAllocation) -> ParallelState:
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ParallelState(
        alloc=alloc,
        groups=ProcessGroupCollection.use_mpu_process_groups(),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        cp_rank=mpu.get_context_parallel_rank(),
        replica_rank=mpu.get_data_parallel_rank(with_context_parallel=True),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        edp_rank=mpu.get_expert_data_parallel_rank(),
    )


def seed_everything(seed: int, state: ParallelState) -> None:
    """Seed Python, numpy and torch; Megatron's RNG tracker gets its TP/EP-offset streams."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, tp_rank=state.tp_rank, ep_rank=state.ep_rank, etp_rank=state.etp_rank
    )
