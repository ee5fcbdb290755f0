"""Rollout correction: importance weights for the gap between the servers' policy and the trainer's.

The servers sample with the behaviour policy (their logprobs come back with every token);
the trainer's proximal policy (its weights before the update) differs from it by staleness
and by the train/inference numerical gap (kernels, dtypes, a sampler's top-p). Decoupled
PPO weights each token's loss by ``w = exp(prox_logp - behav_logp)``; what is done with
large (or small) weights is the correction, as in verl's ``rollout_corr``, AReaL's
``behav_imp_weight_cap``, slime's ``--use-tis`` and NeMo-RL's ``icepop``:

============== ============================== ==================================
mode           weight of a kept token          zero loss where
============== ============================== ==================================
truncate (TIS) ``min(w, upper)``               never
mask (MIS)     ``w``                           ``w > upper``
two_sided_mask ``w``                           ``w < lower`` or ``w > upper``
(IcePop)
============== ============================== ==================================

At sequence level ``w`` is the geometric mean over the sequence's loss tokens,
``exp(mean(prox_logp - behav_logp))``, and a mask drops whole sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.actor.segments import segment_sum, sequence_ids
from megarl.config.ppo import RolloutCorrectionConfig


@dataclass
class BehaviourWeights:
    """Per-token weights [T] of the loss and the tokens they keep, with what the stats report."""

    weight: torch.Tensor  # [T] float: the (truncated) weight multiplying the token loss
    kept: torch.Tensor  # [T] bool: mask tokens whose loss counts (masked ones give zero)
    raw: torch.Tensor  # [T] float: w before truncation (sequence-level: broadcast)
    truncated: torch.Tensor  # [T] bool: mask tokens whose weight was truncated
    masked: torch.Tensor  # [T] bool: mask tokens dropped by the mask


def behaviour_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    cu_seqlens: torch.Tensor | None = None,
) -> BehaviourWeights:
    """The correction of ``config`` for packed tokens (``cu_seqlens`` is needed at sequence level).

    ``mode: none`` gives the uncorrected ``w`` with nothing truncated or masked.
    """
    mask = loss_mask.bool()
    log_w = torch.where(
        mask, prox_logp.detach().float() - behav_logp.float(), torch.zeros_like(prox_logp, dtype=torch.float)
    )
    if config.level == "sequence":
        if cu_seqlens is None:
            raise ValueError("rollout_correction.level='sequence' needs cu_seqlens")
        lengths = segment_sum(mask.float(), cu_seqlens).clamp(min=1)
        log_w = (segment_sum(log_w, cu_seqlens) / lengths)[sequence_ids(cu_seqlens, log_w.numel())]
    raw = torch.exp(log_w)
    none = torch.zeros_like(mask)
    if config.mode == "truncate":
        truncated = mask & (raw > config.upper)
        return BehaviourWeights(raw.clamp(max=config.upper), mask, raw, truncated, none)
    if config.mode in ("mask", "two_sided_mask"):
        masked = mask & ((raw > config.upper) | (raw < config.lower_bound))
        return BehaviourWeights(raw, mask & ~masked, raw, none, masked)
    return BehaviourWeights(raw, mask, raw, none, none)


def capped_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, loss_mask: torch.Tensor, cap: float | None):
    """AReaL's ``behav_imp_weight_cap``: a token-level mask at ``cap`` (no cap: plain weights)."""
    config = RolloutCorrectionConfig() if cap is None else RolloutCorrectionConfig(mode="mask", upper=cap)
    return behaviour_weights(prox_logp, behav_logp, loss_mask, config)
