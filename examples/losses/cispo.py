"""A user loss in one file: CISPO (MiniMax-M1, 2025), a clipped-IS-weight policy gradient.

Run it by config alone (no edit in megarl/):

    megarl run configs/arithmetic_grpo_cpu.yaml actor.loss=examples.losses.cispo.cispo_loss

PPO's clip zeroes the gradient of a token whose ratio left the trust region, so rare tokens
that matter for reasoning stop learning after the first update. CISPO keeps every token's
gradient and clips the importance weight instead:
``loss_t = -clip(r_t, max=1 + eps_clip_higher).detach() * A_t * logp_t``.

A loss is ``fn(logprobs, anchor_logprobs, advantages, loss_mask, *, cu_seqlens, config, **loss_kwargs)``
on packed tokens [T]: the current logprobs (with gradient), the proximal (decoupled PPO) or old
logprobs, the advantages, the loss mask, the sequence starts, the actor config and the keys of
``actor.loss_kwargs`` (none here: CISPO reads its bound from ``actor.eps_clip_higher``). It
returns the per-token loss, optionally with per-token stats. megarl applies the behaviour
weight, the KL and entropy terms and ``actor.loss_agg_mode`` around it.
"""

from __future__ import annotations

import torch


def cispo_loss(logprobs, anchor_logprobs, advantages, loss_mask, *, cu_seqlens, config):
    ratio = torch.exp(logprobs.detach() - anchor_logprobs)
    upper = 1.0 + (config.eps_clip_higher if config.eps_clip_higher is not None else config.eps_clip)
    weight = ratio.clamp(max=upper)
    loss = -weight * advantages * logprobs
    return loss, {"cispo_clipped": (ratio > upper).float()}
