"""Megatron's (distributed) optimizer and the LR schedule, from megarl's ``OptimizerConfig``.

Parameters train in the model dtype (bf16 by default) with fp32 main parameters,
fp32 main gradients and fp32 Adam state (Megatron's mixed-precision optimizer);
``use_distributed_optimizer`` shards that state over data-parallel ranks.

LR schedule: linear warmup over ``warmup_steps_proportion * total_steps`` steps from 0,
then constant, or linear / cosine decay to ``min_lr_ratio * lr`` at ``total_steps``.
"""

from __future__ import annotations

import logging

import torch

from megarl.config.train import OptimizerConfig

logger = logging.getLogger(__name__)


def megatron_optimizer_config(cfg: OptimizerConfig, params_dtype: torch.dtype):
    """Megatron's ``OptimizerConfig`` for megarl's."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    return MegatronOptimizerConfig(
        optimizer=cfg.type,
        lr=cfg.lr,
        min_lr=cfg.lr * cfg.min_lr_ratio,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.beta1,
        adam_beta2=cfg.beta2,
        adam_eps=cfg.eps,
        clip_grad=cfg.gradient_clipping,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        params_dtype=params_dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )


def build_optimizer(cfg: OptimizerConfig, chunks: list, params_dtype: torch.dtype, pg_collection=None):
    """Megatron optimizer over the (DDP-wrapped) model chunks."""
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(megatron_optimizer_config(cfg, params_dtype), chunks, pg_collection=pg_collection)


def build_lr_scheduler(cfg: OptimizerConfig, optimizer, total_steps: int):
    """Warmup + constant / linear / cosine schedule over ``total_steps`` optimizer steps."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1 for the LR schedule, got {total_steps}")
    warmup = int(cfg.warmup_steps_proportion * total_steps)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.lr * cfg.min_lr_ratio,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, warmup + 1),
        lr_decay_style=cfg.lr_scheduler_type,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=total_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
    )
