"""What an engine's config asks of the model build on this machine, from ``TrainEngineConfig`` alone.

The choices :meth:`megarl.actor.engine.MegatronEngine.initialize` hands to Megatron: the parameter
dtype, TransformerEngine's layers or megarl's own, shared-prefix packing, activation recompute, and
the MoE token dispatcher and auxiliary loss. Each is a function of the config and of whether a GPU
is here, so it is checked without building a model.
"""

from __future__ import annotations

from megarl.actor import cpu_shim
from megarl.config.train import TrainEngineConfig
from megarl.models.spec import resolve_use_te
from megarl.utils.hardware import concrete_dtype


def param_dtype(config: TrainEngineConfig) -> str:
    """``config.dtype``, with ``auto`` resolved for this machine."""
    return concrete_dtype(config.dtype, "cuda" if cpu_shim.cuda_available() else "cpu")


def use_transformer_engine(config: TrainEngineConfig) -> bool:
    """Whether the layers are TransformerEngine's (``megatron.use_transformer_engine``; None: where it runs)."""
    requested = config.megatron.use_transformer_engine
    if requested is None and config.lora.enabled:
        return False  # LoRA wraps Megatron's own linears; the config check refuses TE with LoRA
    return resolve_use_te(requested, cpu_shim.cuda_available())


def share_prefix(config: TrainEngineConfig, context_parallel: int = 1) -> bool:
    """``mb_spec.share_prefix`` resolved: only megarl's SDPA attention reads a shared-prefix layout, and
    only without context parallelism (``context_parallel`` ranks split each sequence)."""
    requested = config.mb_spec.share_prefix
    te = use_transformer_engine(config)
    if requested and te:
        raise ValueError(
            "actor.mb_spec.share_prefix=true needs megarl's SDPA attention, but this engine uses "
            "TransformerEngine's: set megatron.use_transformer_engine=false, or share_prefix=null/false"
        )
    if requested and context_parallel > 1:
        raise ValueError(
            f"actor.mb_spec.share_prefix=true packs a group's prompt once, which context parallel "
            f"c{context_parallel} cannot split: set share_prefix=null/false, or drop 'c' from allocation_mode"
        )
    return not te and context_parallel == 1 if requested is None else requested


def recompute_granularity(config: TrainEngineConfig) -> str:
    """Activation recompute: ``full`` with ``gradient_checkpointing``, else ``megatron.recompute_granularity``."""
    return "full" if config.gradient_checkpointing else config.megatron.recompute_granularity


def moe_aux_loss_coeff(config: TrainEngineConfig) -> float:
    """The load-balancing loss's weight: ``megatron.moe_aux_loss_coeff`` under ``aux_loss`` balancing, else 0."""
    megatron = config.megatron
    return megatron.moe_aux_loss_coeff if megatron.moe_router_load_balancing_type == "aux_loss" else 0.0
