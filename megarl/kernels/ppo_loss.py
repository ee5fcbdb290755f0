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
loss terms, gradient and statistics in one pass over [T]; elsewhere the same math in torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from megarl.kernels import _cuda

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
    backend: Literal["cuda", "torch"]


def ppo_terms_torch(logp, old_logp, prox_logp, adv, mask, spec: _Spec):
    """Torch twin of the CUDA kernel: (loss_tok [T], grad_tok [T], raw stats [9])."""
    denorm = old_logp if prox_logp is None else prox_logp
    kl = logp - denorm
    ratio = kl.exp()
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - spec.eps_low, 1.0 + spec.eps_high)
    clipped = l1 < l2
    pg = torch.where(clipped, l2, l1)
    dpg = torch.where(clipped, 0.0, l1)  # d pg / d logp = (d pg / d r) r
    dual = torch.zeros_like(mask)
    if spec.dual_clip is not None:
        l3 = spec.dual_clip * adv.abs()
        dual = l3 < pg
        pg = torch.where(dual, l3, pg)
        dpg = torch.where(dual, 0.0, dpg)
    behav = torch.ones_like(logp)
    capped = torch.zeros_like(mask)
    if prox_logp is not None:
        behav = (prox_logp - old_logp).exp()
        if spec.behav_cap is not None:
            capped = ~(behav <= spec.behav_cap)
            behav = torch.where(capped, 0.0, behav)
    zero = torch.zeros_like(logp)
    masked_ratio = torch.where(mask, ratio, zero)
    raw = torch.stack(
        [
            mask.sum(dtype=torch.float32),
            (clipped & mask).sum(dtype=torch.float32),
            (dual & mask).sum(dtype=torch.float32),
            masked_ratio.sum(),
            torch.where(mask, kl, zero).sum(),
            torch.where(mask, behav, zero).sum(),
            (capped & mask).sum(dtype=torch.float32),
            torch.cat([masked_ratio, zero.new_zeros(1)]).amax(),
            torch.cat([torch.where(mask, ratio, math.inf), zero.new_full((1,), math.inf)]).amin(),
        ]
    )
    return torch.where(mask, behav * pg, zero), torch.where(mask, behav * dpg, zero), raw


def _ppo_terms(logp, old_logp, prox_logp, adv, mask, spec: _Spec):
    if spec.backend == "cuda":
        return _cuda.load_extension().ppo_loss(
            logp, old_logp, prox_logp, adv, mask, spec.eps_low, spec.eps_high,
            spec.dual_clip or 0.0, spec.behav_cap or 0.0,
        )
    return ppo_terms_torch(logp, old_logp, prox_logp, adv, mask, spec)


class _PPOLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, prox_logp, adv, mask, denominator, spec: _Spec):
        loss_tok, grad_tok, raw = _ppo_terms(logp, old_logp, prox_logp, adv, mask, spec)
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
    backend: Literal["auto", "cuda", "torch"] = "auto",
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
        backend: "cuda" (one elementwise kernel), "torch", or "auto".
    """
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    others = dict(old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask, prox_logprobs=prox_logprobs)
    _check(logprobs, others, eps_clip, eps_clip_high, dual_clip, behav_imp_weight_cap)
    if backend not in ("auto", "cuda", "torch"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'torch', got {backend!r}")
    on_cuda = logprobs.is_cuda and _cuda.load_extension() is not None
    if backend == "cuda" and not on_cuda:
        raise ValueError(f"backend='cuda' needs CUDA tensors and megarl._C; logprobs are on {logprobs.device}")
    use_cuda = on_cuda and backend != "torch"
    spec = _Spec(eps_clip, eps_clip_high, dual_clip, behav_imp_weight_cap, "cuda" if use_cuda else "torch")

    def flat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().reshape(-1).float().contiguous()

    mask = loss_mask.reshape(-1).to(torch.bool).contiguous()
    logp = logprobs.reshape(-1).float()
    if spec.backend == "cuda":
        logp = logp.contiguous()
    loss, raw = _PPOLoss.apply(
        logp, flat(old_logprobs), flat(prox_logprobs), flat(advantages), mask, denominator, spec
    )
    return loss, _finalize(raw)
