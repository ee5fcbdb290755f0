"""PPO / GRPO clipped-surrogate loss over per-token logprobs, with its analytic gradient.

Semantics follow AReaL's ``ppo_actor_loss_fn`` (decoupled PPO): with ``prox_logprobs`` the
importance ratio is taken against the proximal policy and each token is weighted by the
behaviour importance weight exp(prox - old), tokens whose weight exceeds
``behav_imp_weight_cap`` being dropped (they still count in the token-mean denominator).

Per masked token (A = advantage):
    r = exp(logp - prox);  pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    dual clip c > 1:  pg = min(pg, c |A|)          (binds only for A < 0)
    loss = sum_t w_t pg_t / denominator            (denominator: masked token count by default)
The gradient wrt logp is w r (-A) / denominator where neither clip binds, else 0 (at exact
ties between branches the unclipped branch is taken). On CUDA one elementwise kernel yields
loss terms, gradient and statistics in one pass over [T]. Elsewhere the loss is the actor's
``megarl.actor.losses.policy_loss`` under autograd (the one torch implementation of the
surrogate; tests/kernels hold the CUDA kernel to it), with the same statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from megarl.actor.losses import PolicyLossOutput, policy_loss
from megarl.kernels import _cuda
from megarl.kernels.backend import Backend, pick_backend

# Layout of the raw statistics vector (csrc/kernels.h, enum PPOStat).
_COUNT, _CLIPPED, _DUAL, _RATIO_SUM, _KL_SUM, _BEHAV_SUM, _CAPPED, _RATIO_MAX, _RATIO_MIN = range(9)


@dataclass(frozen=True)
class PPOLossStats:
    """Statistics over the masked tokens, as 0-d fp32 tensors (no host synchronisation)."""

    num_tokens: torch.Tensor
    """Masked (trained-on) tokens."""
    clip_fraction: torch.Tensor
    """Share of tokens where the clipped surrogate is the active branch."""
    dual_clip_fraction: torch.Tensor
    """Share of tokens where the dual clip binds."""
    importance_weight_mean: torch.Tensor
    """Mean ratio exp(logp - prox)."""
    importance_weight_min: torch.Tensor
    importance_weight_max: torch.Tensor
    approx_kl: torch.Tensor
    """Mean of logp - prox."""
    behav_weight_mean: torch.Tensor
    """Mean behaviour weight exp(prox - old) after the cap (1 without prox_logprobs)."""
    behav_capped_fraction: torch.Tensor
    """Share of tokens dropped by the behaviour-weight cap."""


@dataclass(frozen=True)
class _Spec:
    eps_low: float
    eps_high: float
    dual_clip: float | None
    behav_cap: float | None


def _raw_stats(out: PolicyLossOutput, kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The kernel's raw statistics vector [9] from the torch path's per-token outputs."""
    zero = torch.zeros_like(kl)
    behav = torch.ones_like(kl) if out.behav_weight is None else torch.where(out.capped, 0.0, out.behav_weight)
    masked_ratio = torch.where(mask, out.ratio, zero)
    return torch.stack(
        [
            mask.sum(dtype=torch.float32),
            out.clipped.sum(dtype=torch.float32),
            out.dual_clipped.sum(dtype=torch.float32),
            masked_ratio.sum(),
            torch.where(mask, kl, zero).sum(),
            torch.where(mask, behav, zero).sum(),
            out.capped.sum(dtype=torch.float32),
            torch.cat([masked_ratio, zero.new_zeros(1)]).amax(),
            torch.cat([torch.where(mask, out.ratio, math.inf), zero.new_full((1,), math.inf)]).amin(),
        ]
    )


def _torch_loss(logp, old_logp, prox_logp, adv, mask, denominator, spec: _Spec):
    """The torch path: ``megarl.actor.losses.policy_loss`` under autograd, plus the kernel's raw stats."""
    out = policy_loss(
        logp,
        old_logp,
        adv,
        mask,
        eps_clip=spec.eps_low,
        eps_clip_higher=spec.eps_high,
        c_clip=spec.dual_clip,
        proximal_logprobs=prox_logp,
        behav_imp_weight_cap=spec.behav_cap,
    )
    anchor = old_logp if prox_logp is None else prox_logp
    raw = _raw_stats(out, logp.detach() - anchor, mask)
    denom = raw[_COUNT].clamp(min=1.0) if denominator is None else denominator
    return out.loss.sum() / denom, raw


class _CudaPPOLoss(torch.autograd.Function):
    """The CUDA path: one kernel gives per-token loss and analytic gradient; backward only scales it."""

    @staticmethod
    def forward(ctx, logp, old_logp, prox_logp, adv, mask, denominator, spec: _Spec):
        loss_tok, grad_tok, raw = _cuda.load_extension().ppo_loss(
            logp,
            old_logp,
            prox_logp,
            adv,
            mask,
            spec.eps_low,
            spec.eps_high,
            spec.dual_clip or 0.0,
            spec.behav_cap or 0.0,
        )
        denom = raw[_COUNT].clamp(min=1.0) if denominator is None else denominator
        ctx.save_for_backward(grad_tok, torch.as_tensor(denom, dtype=torch.float32, device=logp.device))
        ctx.mark_non_differentiable(raw)
        return loss_tok.sum() / denom, raw

    @staticmethod
    def backward(ctx, g_loss, _g_raw):
        grad_tok, denom = ctx.saved_tensors
        return grad_tok * (g_loss / denom), None, None, None, None, None, None


def _finalize(raw: torch.Tensor) -> PPOLossStats:
    count = raw[_COUNT]
    n = count.clamp(min=1.0)
    return PPOLossStats(
        num_tokens=count,
        clip_fraction=raw[_CLIPPED] / n,
        dual_clip_fraction=raw[_DUAL] / n,
        importance_weight_mean=raw[_RATIO_SUM] / n,
        importance_weight_min=torch.where(count > 0, raw[_RATIO_MIN], torch.zeros_like(count)),
        importance_weight_max=raw[_RATIO_MAX],
        approx_kl=raw[_KL_SUM] / n,
        behav_weight_mean=raw[_BEHAV_SUM] / n,
        behav_capped_fraction=raw[_CAPPED] / n,
    )


def _check(logprobs, others: dict, eps_clip, eps_clip_high, dual_clip, behav_imp_weight_cap) -> None:
    for name, t in others.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if not 0 <= eps_clip < 1 or eps_clip_high < 0:
        raise ValueError(f"need 0 <= eps_clip < 1 and eps_clip_high >= 0, got {eps_clip}, {eps_clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    if behav_imp_weight_cap is not None and not behav_imp_weight_cap > 0:
        raise ValueError(f"behav_imp_weight_cap must be > 0 (or None), got {behav_imp_weight_cap}")


def fused_ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    prox_logprobs: torch.Tensor | None = None,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    behav_imp_weight_cap: float | None = None,
    denominator: torch.Tensor | float | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, PPOLossStats]:
    """Clipped PPO/GRPO surrogate loss (a 0-d tensor, differentiable wrt ``logprobs``) and stats.

    Args:
        logprobs: current-policy logprobs of the sampled tokens, any shape.
        old_logprobs: behaviour-policy logprobs (those recorded at rollout), same shape.
        advantages, loss_mask: same shape; the mask selects trained-on tokens.
        prox_logprobs: proximal-policy logprobs for decoupled PPO (None: classic PPO).
        eps_clip: lower clip, ratio >= 1 - eps_clip; ``eps_clip_high`` the upper one
            (default eps_clip), for asymmetric clipping.
        dual_clip: c > 1 caps the loss of negative-advantage tokens at c |A|.
        behav_imp_weight_cap: drop tokens whose exp(prox - old) exceeds it.
        denominator: what the summed loss is divided by (default: masked token count), e.g.
            a global token count across micro-batches and data-parallel ranks.
        backend: "cuda" (one elementwise kernel), "torch" (``megarl.actor.losses.policy_loss``
            under autograd), or "auto" (CUDA for CUDA tensors where megarl._C loads).
    """
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    others = {
        "old_logprobs": old_logprobs,
        "advantages": advantages,
        "loss_mask": loss_mask,
        "prox_logprobs": prox_logprobs,
    }
    _check(logprobs, others, eps_clip, eps_clip_high, dual_clip, behav_imp_weight_cap)
    spec = _Spec(eps_clip, eps_clip_high, dual_clip, behav_imp_weight_cap)

    def flat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().reshape(-1).float().contiguous()

    mask = loss_mask.reshape(-1).to(torch.bool).contiguous()
    logp = logprobs.reshape(-1).float()
    args = (flat(old_logprobs), flat(prox_logprobs), flat(advantages), mask, denominator, spec)
    if ppo_loss_backend(backend, logprobs) == "cuda":
        loss, raw = _CudaPPOLoss.apply(logp.contiguous(), *args)
    else:
        loss, raw = _torch_loss(logp, *args)
    return loss, _finalize(raw)


def ppo_loss_backend(backend: Backend, logprobs: torch.Tensor) -> Literal["cuda", "torch"]:
    """The implementation :func:`fused_ppo_loss` runs for ``logprobs`` under ``backend``."""
    needs = f"CUDA tensors and megarl._C; logprobs are on {logprobs.device}"
    return pick_backend(backend, lambda: logprobs.is_cuda and _cuda.load_extension() is not None, needs)
