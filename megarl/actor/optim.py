"""Megatron's (distributed) optimizer and the LR schedule, from megarl's ``OptimizerConfig``.

Parameters train in the model dtype (bf16 by default) with fp32 main parameters,
fp32 main gradients and fp32 Adam state (Megatron's mixed-precision optimizer);
``use_distributed_optimizer`` shards that state over data-parallel ranks. With bf16 / fp16
weights the main parameters are dithered within their rounding cell when the optimizer is
built (:func:`dither_main_params`), so that updates smaller than half a bf16 step still reach
the weights the model computes with (``docs/concepts/precision.md``).

LR schedule: linear warmup over ``warmup_steps_proportion * total_steps`` steps from 0,
then constant, or linear / cosine decay to ``min_lr_ratio * lr`` at ``total_steps``.
"""

from __future__ import annotations

import functools
import logging
import math

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
    """Megatron optimizer over the (DDP-wrapped) model chunks, its main parameters dithered
    when ``cfg.bf16_rounding`` asks for it."""
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(
        megatron_optimizer_config(cfg, params_dtype), chunks, pg_collection=pg_collection
    )
    if cfg.bf16_rounding == "dithered" and params_dtype != torch.float32:
        dither_main_params(optimizer, params_dtype)
    use_fused_adam(optimizer)
    return optimizer


def use_fused_adam(optimizer) -> int:
    """Run torch's Adam / AdamW inside Megatron's optimizer as torch's fused kernel; returns the
    number of parameter groups switched.

    Without TransformerEngine or Apex (always on CPU) Megatron builds ``torch.optim.Adam(W)``
    without choosing an implementation, and for CPU tensors torch then takes its per-tensor
    loop: about a dozen elementwise passes and temporaries per parameter. The fused kernel does
    the same update in one vectorised pass (3.7x faster for a 135M-parameter model's step on a
    2-core AVX2 CPU; ``benchmarks/train_phase.py``). Called again after an optimizer state is
    loaded, whose parameter groups carry the ``fused`` flag they were saved with.
    """
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue  # TransformerEngine's or Apex's FusedAdam already is one
        for group in inner.param_groups:
            params = group["params"]
            if group.get("differentiable") or not all(p.is_floating_point() for p in params):
                continue
            if any(p.device.type not in ("cpu", "cuda") for p in params) or group["fused"]:
                continue
            group.update(fused=True, foreach=False)
            switched += 1
    return switched


def main_params_of_low_precision(optimizer) -> list[torch.Tensor]:
    """The fp32 main parameters (or this rank's shards of them) behind the bf16 / fp16 weights."""
    mains = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        # Float16OptimizerWithFloat16Params, or DistributedOptimizer (this rank's shards)
        groups = getattr(opt, "fp32_from_float16_groups", None) or getattr(opt, "shard_fp32_from_float16_groups", [])
        mains += [param for group in groups for param in group]
    return mains


@torch.no_grad()
def dither_main_params(optimizer, dtype: torch.dtype, seed: int = 0) -> None:
    """Move each fp32 main parameter by a uniform random offset within its ``dtype`` rounding cell.

    The ``dtype`` copy the model computes with is unchanged (every element still rounds to its
    loaded value), but the main parameters no longer sit on the ``dtype`` grid: a later update of
    size ``d`` flips an element with probability ``|d| / step``, so the rounded weights follow the
    main parameters in expectation instead of staying put until an update passes half a step.
    The draws depend only on ``seed`` and the order of the parameters, so replicas of a parameter
    (data-parallel copies, tensor-parallel norms) get the same offsets. Main parameters that have
    trained already (a checkpoint written with round-to-nearest) can be dithered too: an element
    whose rounding the offset would change keeps its value.

    The offset is drawn in the bits: an fp32 number on the ``dtype`` grid has its lowest
    ``23 - mantissa bits`` bits zero (16 for bf16), and adding a uniform integer of magnitude below
    half that range stays inside its rounding cell, across a power of two too (bit patterns grow
    with the value). One random integer and a few elementwise ops per element, on the parameters'
    own device.
    """
    low_bits = 23 - round(-math.log2(torch.finfo(dtype).eps))  # fp32 mantissa bits below dtype's: 16 for bf16
    half = (1 << (low_bits - 1)) - 1
    generators: dict[torch.device, torch.Generator] = {}
    for main in main_params_of_low_precision(optimizer):
        if main.device not in generators:
            generators[main.device] = torch.Generator(device=main.device).manual_seed(seed)
        offset = torch.randint(
            -half, half + 1, main.shape, generator=generators[main.device], device=main.device, dtype=torch.int32
        )
        dithered = (main.view(torch.int32) + offset).view(torch.float32)
        # zero has no cell (its bits would wrap to NaN); anything that would round elsewhere stays as it is
        keep = (main != 0) & (dithered.to(dtype) == main.to(dtype))
        main.copy_(torch.where(keep, dithered, main))


def build_lr_scheduler(cfg: OptimizerConfig, optimizer, total_steps: int):
    """Warmup + constant / linear / cosine schedule over ``total_steps`` optimizer steps.

    On resume the step count comes from the checkpoint and the settings from ``cfg`` (Megatron's
    ``override_opt_param_scheduler``): a run resumed with another ``lr`` or ``total_train_steps``
    follows them from its step on, with a warning naming what changed.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1 for the LR schedule, got {total_steps}")
    warmup = int(cfg.warmup_steps_proportion * total_steps)
    return _config_scheduler_class()(
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
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


@functools.cache
def _config_scheduler_class():
    """Megatron's ``OptimizerParamScheduler`` whose settings, on resume, are the config's (imported late)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class ConfigScheduler(OptimizerParamScheduler):
        def _check_and_set(self, cls_value, sd_value, name):
            if cls_value != sd_value:
                logger.warning(
                    "resumed with %s %s, the recover point's was %s: the schedule follows the config from step %d on",
                    name,
                    cls_value,
                    sd_value,
                    self.num_steps,
                )
            return cls_value

    return ConfigScheduler


def wrap_chunks(chunks: list, tconfig, config) -> list:
    """An engine's model chunks as it computes with them: in ``Float16Module`` for bf16 / fp16 weights;
    frozen without an optimizer (a reference model), else in Megatron's DDP, whose gradient hooks the
    pipeline schedules reach through ``tconfig`` (``no_sync_func``, ``finalize_model_grads_func``, ...).

    ``config``: the engine's :class:`~megarl.config.train.TrainEngineConfig`."""
    from megatron.core.transformer.module import Float16Module

    if tconfig.params_dtype != torch.float32:
        chunks = [Float16Module(tconfig, chunk) for chunk in chunks]
    if config.optimizer is None:
        for chunk in chunks:
            chunk.requires_grad_(False)
        return chunks
    return _wrap_ddp(chunks, tconfig, config)


def _wrap_ddp(chunks: list, tconfig, config) -> list:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=config.megatron.overlap_grad_reduce,
        overlap_param_gather=config.megatron.overlap_param_gather,
        use_distributed_optimizer=config.optimizer.use_distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(tconfig, ddp_config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)
    ]
    no_sync = [chunk.no_sync for chunk in wrapped]
    tconfig.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    tconfig.finalize_model_grads_func = finalize_model_grads
    if config.megatron.overlap_grad_reduce:
        grad_sync = [chunk.start_grad_sync for chunk in wrapped]
        tconfig.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    return wrapped


def build_optimizer_and_schedule(
    cfg: OptimizerConfig, model: list, tconfig, overlap_param_gather: bool, total_steps: int | None
):
    """The optimizer of the DDP-wrapped ``model`` and its LR schedule over ``total_steps`` (required when the
    schedule decays or warms up), with the loss-scale and parameter-gather hooks set on ``tconfig``."""
    optimizer = build_optimizer(cfg, model, tconfig.params_dtype)
    tconfig.grad_scale_func = optimizer.scale_loss
    if overlap_param_gather:
        sync = [chunk.start_param_sync for chunk in model]
        tconfig.param_sync_func = sync[0] if len(sync) == 1 else sync
    needs_steps = cfg.lr_scheduler_type != "constant" or cfg.warmup_steps_proportion > 0
    if total_steps is None and needs_steps:
        raise ValueError(
            f"lr_scheduler_type={cfg.lr_scheduler_type!r} / warmup_steps_proportion="
            f"{cfg.warmup_steps_proportion} need ft_spec (total training steps)"
        )
    return optimizer, build_lr_scheduler(cfg, optimizer, total_steps or 1)


def finish_param_gathers(chunks: list) -> None:
    """Gather the parameters the distributed optimizer's last step updated (``megatron.overlap_param_gather``,
    where Megatron leaves the all-gather to the next forward's hooks); collective. Without it the weight
    sync, a checkpoint or the HF export right after a step read each rank's own shard updated and every
    other one from the step before.

    Every bucket group gathers anew, all dispatched before any is waited for: Megatron marks a group
    gathered from the forward that gathered it until the next pass's gradient reduction, so a step that
    ran no pass (nothing to learn on any rank) would otherwise keep the other ranks' shards of the step
    before."""
    groups = [
        group
        for chunk in chunks
        if (config := getattr(chunk, "ddp_config", None)) is not None
        and config.use_distributed_optimizer
        and config.overlap_param_gather
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups
    ]
    for group in groups:
        if group.param_gather_handle is not None:
            group.start_param_sync(force_sync=True)  # only waits for the gather an earlier forward left open
        group.start_param_sync()  # asynchronous under overlap_param_gather
    for group in groups:
        group.finish_param_sync(skip_next_bucket_dispatch=True)
