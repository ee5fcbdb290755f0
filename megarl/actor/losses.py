"""PPO / GRPO policy losses as pure functions of per-token tensors.

Every function takes packed token tensors of shape [T] (several sequences laid end
to end, as the Megatron engine feeds them) and, where sequences matter,
``cu_seqlens`` [N+1] with the start offset of each sequence. A padded [B, S] batch
is the special case ``cu_seqlens = arange(B + 1) * S`` after flattening.

The variants and where they come from:
- clipped surrogate, asymmetric clip (``eps_clip_higher``, DAPO) and dual clip
  (``c_clip``, for negative advantages);
- decoupled PPO (AReaL): clip against the proximal policy, weight each token by
  the behaviour importance weight ``exp(prox - old)``, drop tokens above a cap;
- GSPO: one length-normalised ratio per sequence instead of one per token;
- KL to a reference policy with Schulman's k1 / k2 / k3 estimators;
- aggregation: token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm
  (Dr.GRPO).

Aggregation returns a (sum, weight) pair rather than a mean so that the engine can
divide by the weight summed over micro-batches, data-parallel ranks and pipeline
stages: the loss of a mini-batch is then exact however it was split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megarl.actor.rollout_correction import behaviour_weights, capped_weights
from megarl.actor.segments import segment_sum, sequence_ids
from megarl.config.ppo import RolloutCorrectionConfig

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass
class SurrogateOutput:
    """A per-token policy-gradient loss before the behaviour weight, and its clip statistics."""

    loss: torch.Tensor  # [T]
    ratio: torch.Tensor  # [T] detached ratio used in the surrogate (token or broadcast sequence ratio)
    clipped: torch.Tensor  # [T] bool: the clipped branch was taken
    dual_clipped: torch.Tensor  # [T] bool: the dual clip bound was taken


@dataclass
class PolicyLossOutput:
    """Per-token policy loss and what the stats need; ``mask`` excludes dropped tokens."""

    loss: torch.Tensor  # [T], zero where mask is False
    mask: torch.Tensor  # [T] bool: loss_mask (capped tokens stay in it: they count in the denominator)
    ratio: torch.Tensor  # [T] ratio used in the surrogate (token or broadcast sequence ratio)
    clipped: torch.Tensor  # [T] bool: the clipped branch was taken
    dual_clipped: torch.Tensor  # [T] bool: the dual clip bound was taken
    behav_weight: torch.Tensor | None  # [T] exp(prox - old) (sequence level: geometric mean) when decoupled
    capped: torch.Tensor  # [T] bool: tokens masked by the cap or the rollout correction (loss zeroed)
    truncated: torch.Tensor | None = None  # [T] bool: tokens whose weight was truncated (TIS)


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate ``max(-A r, -A clip(r, 1-eps, 1+eps_high))`` per token.

    With ``c_clip`` (> 1), the loss of a negative-advantage token is further bounded by
    ``-c_clip * A`` (dual clip), so one huge ratio cannot dominate the update.
    Returns (loss, clipped, dual_clipped).
    """
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    dual_clipped = torch.zeros_like(clipped)
    if c_clip is not None:
        bound = -advantages * c_clip
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return loss, clipped, dual_clipped


def gspo_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence ratio ``exp(mean_t log r_t)``, broadcast to tokens as GSPO-token does.

    The value of every token is its sequence's ratio; its gradient flows through the
    token's own logprob: ``r_seq.detach() * exp(log r_t - log r_t.detach())``.
    """
    masked = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    lengths = segment_sum(mask.to(log_ratio.dtype), cu_seqlens).clamp(min=1)
    seq_log_ratio = segment_sum(masked.detach(), cu_seqlens) / lengths  # [N]
    per_token = seq_log_ratio[sequence_ids(cu_seqlens, log_ratio.numel())]
    return torch.exp(per_token) * torch.exp(log_ratio - log_ratio.detach())


def ppo_surrogate(
    logprobs: torch.Tensor,
    anchor_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    importance_sampling_level: Literal["token", "sequence"] = "token",
    cu_seqlens: torch.Tensor | None = None,
) -> SurrogateOutput:
    """PPO's clipped surrogate of the ratio to ``anchor_logprobs``, per token or GSPO's per sequence."""
    mask = loss_mask.bool()
    log_ratio = torch.where(mask, logprobs - anchor_logprobs, torch.zeros_like(logprobs))
    if importance_sampling_level == "sequence":
        if cu_seqlens is None:
            raise ValueError("importance_sampling_level='sequence' (GSPO) needs cu_seqlens")
        ratio = gspo_ratio(log_ratio, mask, cu_seqlens)
    else:
        ratio = torch.exp(log_ratio)
    loss, clipped, dual_clipped = clipped_surrogate(ratio, advantages, eps_clip, eps_clip_higher, c_clip)
    return SurrogateOutput(loss, ratio.detach(), clipped & mask, dual_clipped & mask)


def weigh_by_behaviour(
    surrogate: SurrogateOutput,
    loss_mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    *,
    behav_imp_weight_cap: float | None = None,
    correction: RolloutCorrectionConfig | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Decoupled PPO: the surrogate times the behaviour weight ``exp(prox - old)``, capped or corrected.

    Without ``proximal_logprobs`` the loss is the surrogate itself. With them, ``correction``
    (a ``rollout_correction`` mode other than none) truncates or masks the weights; otherwise
    ``behav_imp_weight_cap`` masks tokens above it. Masked tokens contribute zero loss but, as
    in AReaL, still count in the token denominator (so a stale batch does not get a larger step).
    """
    mask = loss_mask.bool()
    loss, behav_weight, capped, truncated = surrogate.loss, None, torch.zeros_like(mask), None
    if proximal_logprobs is not None:
        if correction is not None and correction.mode != "none":
            weights = behaviour_weights(proximal_logprobs, old_logprobs, mask, correction, cu_seqlens)
        else:
            weights = capped_weights(proximal_logprobs, old_logprobs, mask, behav_imp_weight_cap)
        # masked first: a masked token's weight may be inf (exp of a huge log-ratio), and 0 * inf has no gradient
        loss = loss * torch.where(weights.masked, torch.zeros_like(weights.weight), weights.weight)
        behav_weight, capped, truncated = weights.raw, weights.masked, weights.truncated
    kept = mask & ~capped
    return PolicyLossOutput(
        loss=torch.where(kept, loss, torch.zeros_like(loss)),
        mask=mask,
        ratio=surrogate.ratio,
        clipped=surrogate.clipped,
        dual_clipped=surrogate.dual_clipped,
        behav_weight=behav_weight,
        capped=capped,
        truncated=truncated,
    )


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    correction: RolloutCorrectionConfig | None = None,
    importance_sampling_level: Literal["token", "sequence"] = "token",
    cu_seqlens: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The PPO policy-gradient loss per token, plain or decoupled, token or GSPO ratio.

    ``old_logprobs`` are the behaviour policy's (the servers' sampling logprobs). With
    ``proximal_logprobs`` (decoupled PPO) the ratio is taken against the proximal policy
    and each token is weighted by ``exp(prox - old)`` (:func:`weigh_by_behaviour`).
    """
    anchor = old_logprobs if proximal_logprobs is None else proximal_logprobs
    surrogate = ppo_surrogate(
        logprobs,
        anchor,
        advantages,
        loss_mask,
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        importance_sampling_level=importance_sampling_level,
        cu_seqlens=cu_seqlens,
    )
    return weigh_by_behaviour(
        surrogate,
        loss_mask,
        old_logprobs,
        proximal_logprobs,
        cu_seqlens=cu_seqlens,
        behav_imp_weight_cap=behav_imp_weight_cap,
        correction=correction,
    )


K3_LOG_RATIO_BOUND = 20.0
K3_BOUND = 10.0
"""verl's bounds on the k3 estimator (``low_var_kl``): the log-ratio, then the estimate."""


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Literal["k1", "k2", "k3"]
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3).

    k3 is bounded as verl's ``low_var_kl`` is: the log-ratio clamped to [-20, 20], the estimate to at
    most 10, so a token the reference finds near impossible neither overflows nor dominates the loss
    (its gradient is 0 beyond the bounds).
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        return (torch.exp(-log_ratio) + log_ratio - 1.0).clamp(max=K3_BOUND)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode,
    cu_seqlens: torch.Tensor | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce a per-token loss to ``(sum, weight)``; the loss is ``sum / weight``.

    - token-mean: every unmasked token weighs the same (DAPO).
    - seq-mean-token-mean: mean over tokens within a sequence, then over sequences (GRPO).
    - seq-mean-token-sum-norm: token sum divided by the constant ``norm_len`` (the
      generation budget), then mean over sequences (Dr.GRPO: no length bias).
    Sequences with no unmasked token do not count.
    """
    mask = mask.bool()
    values = torch.where(mask, token_loss, torch.zeros_like(token_loss))
    if mode == "token-mean":
        return values.sum(), mask.sum().to(values.dtype)
    if cu_seqlens is None:
        raise ValueError(f"loss aggregation {mode!r} needs cu_seqlens")
    per_seq = segment_sum(values, cu_seqlens)
    counts = segment_sum(mask.to(values.dtype), cu_seqlens)
    present = counts > 0
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / counts.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if not norm_len:
            raise ValueError("loss aggregation 'seq-mean-token-sum-norm' (Dr.GRPO) needs norm_len > 0")
        per_seq = per_seq / norm_len
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return torch.where(present, per_seq, torch.zeros_like(per_seq)).sum(), present.sum().to(values.dtype)
