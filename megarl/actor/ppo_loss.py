"""The PPO / GRPO policy loss of one packed micro-batch and its three paths.

:func:`ppo_loss` is what :meth:`~megarl.actor.ppo.MegatronPPOActor.ppo_update` trains on:

1. the head's logprobs and entropies, then ``actor.loss``'s surrogate (:func:`policy_surrogate`:
   PPO's clipped one, or a function of your own, :func:`user_surrogate`), weighted by the
   behaviour weight, plus the KL and entropy terms (:func:`_loss_of_logprobs`);
2. the same loss from the fused CUDA epilogue of :mod:`megarl.actor.fused_ppo_loss` where
   :func:`_fused_surrogate` allows it;
3. gradients computed in the forward (:func:`_ppo_loss_grads_in_forward`) where the head's kernels
   give the loss's gradient with its value, so the logits are never materialised.

All three aggregate with ``actor.loss_agg_mode`` (``megarl.actor.losses.aggregate``) and divide by
:func:`ppo_loss_weight`.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from megarl.actor import losses
from megarl.actor.fused_ppo_loss import fused_ppo_loss, ppo_loss_backend
from megarl.actor.gap import GapMeter
from megarl.actor.lm_head import LMHeadOutput
from megarl.actor.teacher_loss import TeacherTopK, teacher_topk, token_term
from megarl.config.ppo import BUILTIN_LOSSES, PPOActorConfig
from megarl.kernels import Truncation, logprobs_backend
from megarl.utils import stats_tracker
from megarl.utils.plugins import import_plugin

logger = logging.getLogger(__name__)


def _uses_prox(cfg: PPOActorConfig) -> bool:
    """Whether the loss anchors on the current policy's logprobs before the update (proximal policy)."""
    return cfg.recompute_logprob or cfg.use_decoupled_loss


def prox_from_update(cfg: PPOActorConfig) -> bool:
    """Whether ``ppo_update``'s forward gives the proximal logprobs (see ``needs_prox_pass``).

    A KL reward (``kl_in_reward``) needs them earlier, in ``compute_advantages``.
    """
    kl_reward = cfg.kl_ctl > 0 and cfg.kl_in_reward
    return _uses_prox(cfg) and cfg.ppo_n_minibatches == 1 and cfg.ppo_n_epochs == 1 and not kl_reward


def _mask(mb: dict) -> torch.Tensor:
    return mb["loss_mask"].bool() & mb["label_mask"]


def ppo_loss_weight(mb: dict, mode: losses.AggMode) -> torch.Tensor:
    """The weight :func:`ppo_loss` divides by: masked tokens, or sequences with a masked token."""
    mask = _mask(mb)
    return losses.aggregate(torch.zeros(mask.shape), mask, mode, mb["cu_seqlens"].long(), norm_len=1)[1]


def ppo_loss(
    head: LMHeadOutput, mb: dict, cfg: PPOActorConfig, norm_len: int, surrogate_fn=None, gap: GapMeter | None = None
) -> torch.Tensor:
    """PPO / GRPO / DAPO / GSPO loss of one packed micro-batch (``sum / weight`` of ``aggregate``).

    The surrogate is ``actor.loss``'s (:func:`policy_surrogate`: PPO's clipped one, or a user's
    function) weighted by the behaviour weight (``losses.weigh_by_behaviour``); or the fused CUDA
    epilogue of ``megarl.actor.fused_ppo_loss`` where :func:`_fused_surrogate` allows it (the same loss).
    ``surrogate_fn``: ``policy_surrogate(cfg)``, resolved once per update by ``ppo_update``.
    ``gap``: records the train–inference gap of the micro-batch's tokens when given. With the teacher's top k
    in the micro-batch (``teacher.top_k``), the loss gains ``actor.teacher_coef`` x their forward KL
    (:mod:`megarl.actor.teacher_loss`), aggregated as the surrogate.
    """
    mask = _mask(mb)
    truncation = replayed_truncation(cfg)
    top = teacher_topk(head, mb, mask, cfg.temperature)
    if _grads_in_forward(cfg, head):
        return _ppo_loss_grads_in_forward(head, mb, cfg, norm_len, mask, gap, truncation, top)
    logp, entropy, outside = head.logprobs_entropy(
        mb["labels"], cfg.temperature, where=mask, truncation=truncation, return_outside=True
    )  # no head work on prompts
    _record_truncation(truncation, mask, outside)
    return _loss_of_logprobs(head, mb, cfg, norm_len, mask, logp, entropy, surrogate_fn, gap, top)


def _record_truncation(truncation: Truncation | None, mask: torch.Tensor, outside: torch.Tensor) -> None:
    """The share of the micro-batch's tokens whose label fell below its truncation threshold."""
    if truncation is not None:
        stats_tracker.denominator(**{"truncation/n_tokens": mask})
        stats_tracker.stat(denominator="truncation/n_tokens", **{"truncation/label_outside": outside.float()})


def replayed_truncation(cfg: PPOActorConfig) -> Truncation | None:
    """The sampling's top-k / top-p / min-p the trainer replays (``actor.replay_truncation``); None: none."""
    truncation = Truncation(top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
    return truncation if cfg.replay_truncation and truncation.active else None


def _loss_of_logprobs(head, mb, cfg, norm_len, mask, logp, entropy, surrogate_fn, gap, top=None) -> torch.Tensor:
    """The loss of :func:`ppo_loss` from the micro-batch's logprobs and entropies; records the stats."""
    old, prox = _anchors(cfg, mb, logp)
    if gap is not None:
        gap.record(mb, mb["prox_logp"] if "prox_logp" in mb else logp, mask)
    if top is not None:
        _record_teacher_topk(top, mask, logp)
    fused = _fused_surrogate(cfg, head, logp)
    logger.debug(
        "ppo_loss: logprobs on the %s path, surrogate via %s",
        logprobs_backend(head.backend, head.hidden, head.weight),
        "fused_ppo_loss" if fused else "losses.policy_loss",
    )
    if fused:
        return _fused_ppo_loss(head, mb, cfg, mask, logp, entropy, old, prox, top)
    cu_seqlens = mb["cu_seqlens"].long()
    surrogate_fn = surrogate_fn or policy_surrogate(cfg)
    out, surrogate_stats = _policy_loss(cfg, surrogate_fn, mb, mask, logp, old, prox, cu_seqlens)
    token_loss, kl = _add_penalties(out.loss, cfg, mb, mask, logp, entropy, top)
    total, weight = losses.aggregate(token_loss, mask, cfg.loss_agg_mode, cu_seqlens, norm_len)
    _record_stats(mask, logp, entropy, prox if prox is not None else old, kl, out.behav_weight, surrogate_stats)
    return total / weight.clamp(min=1)


def _grads_in_forward(cfg: PPOActorConfig, head: LMHeadOutput) -> bool:
    """Whether :func:`ppo_loss` takes the training path (the head's gradients computed in its forward:
    6·T·V·H FLOPs instead of the 8 of logprobs under autograd), on the head's CUDA or torch path.

    Where the loss is a sum of per-token terms of (logprob, entropy): a built-in surrogate with
    per-token ratios and no sequence-level rollout correction (any aggregation: it only weighs
    the tokens).
    """
    per_token = cfg.importance_sampling_level == "token" and cfg.rollout_correction.mode == "none"
    return per_token and cfg.loss in BUILTIN_LOSSES


def _token_weights(mask: torch.Tensor, cfg: PPOActorConfig, cu_seqlens: torch.Tensor, norm_len: int) -> torch.Tensor:
    """d loss / d token_loss ``[T]`` of the aggregation (linear in the per-token loss)."""
    x = torch.zeros(mask.shape, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        total, weight = losses.aggregate(x, mask, cfg.loss_agg_mode, cu_seqlens, norm_len)
    (coeff,) = torch.autograd.grad(total, x)
    return coeff / weight.detach().clamp(min=1)


def _ppo_loss_grads_in_forward(head, mb, cfg, norm_len, mask, gap, truncation=None, top=None) -> torch.Tensor:
    """:func:`ppo_loss` on the training path: the same loss, its gradient made chunk by chunk in the
    head's forward (``LMHeadOutput.token_loss``; ``truncation``: of the replayed sampling
    distribution, the threshold from each chunk's logits), and the same statistics (from the
    detached logprobs). The teacher's top-k term (``top``) splits: its part in the sampled token's
    logprob goes into the chunks' terms, its logit gaps beside them, weighted alike."""
    logger.debug("ppo_loss: training path (grads in the head's forward), surrogate via losses.policy_loss")
    rows = mask.nonzero().squeeze(-1)  # the head's rows
    weights = _token_weights(mask, cfg, mb["cu_seqlens"].long(), norm_len)
    coeff = weights[rows]
    keys = [k for k in ("logprobs", "prox_logp", "ref_logp", "advantages") if k in mb]
    sub = {k: mb[k][rows] for k in keys}
    top_rows = top.rows(rows) if top is not None else None

    def terms(t0, t1, logp, entropy):
        chunk = {k: v[t0:t1] for k, v in sub.items()}
        on = torch.ones(logp.shape, dtype=torch.bool, device=logp.device)
        old, prox = _anchors(cfg, chunk, logp)
        out, _ = _policy_loss(cfg, _clipped_surrogate, chunk, on, logp, old, prox, None)
        top_chunk = TeacherTopK(top_rows.q[t0:t1], None) if top_rows is not None else None
        token_loss, _ = _add_penalties(out.loss, cfg, chunk, on, logp, entropy, top_chunk)
        return token_loss * coeff[t0:t1]

    loss, logp, entropy, outside = head.token_loss(
        mb["labels"], terms, cfg.temperature, where=mask, truncation=truncation, return_outside=True
    )
    if top is not None:
        loss = loss + cfg.teacher_coef * (top.gap_term * weights).sum()
    _record_truncation(truncation, mask, outside)
    with torch.no_grad():  # statistics only
        _loss_of_logprobs(head, mb, cfg, norm_len, mask, logp, entropy, policy_surrogate(cfg), gap, top)
    return loss


def _policy_loss(cfg: PPOActorConfig, surrogate_fn, mb: dict, mask, logp, old, prox, cu_seqlens):
    """The surrogate of ``cfg.loss`` weighted by the behaviour weight (capped or corrected), and its stats."""
    anchor = prox if prox is not None else old
    surrogate, user_stats = surrogate_fn(
        logp, anchor, mb["advantages"].float(), mask, cu_seqlens=cu_seqlens, config=cfg
    )
    out = losses.weigh_by_behaviour(
        surrogate,
        mask,
        old,
        prox,
        cu_seqlens=cu_seqlens,
        correction=cfg.rollout_correction,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap,
    )
    stats = {
        "importance_weight": out.ratio.float(),
        "clip_ratio": out.clipped.float(),
        "dual_clip_ratio": out.dual_clipped.float(),
        "capped_ratio": out.capped.float(),
        **user_stats,
    }
    if prox is not None:
        stats.update(_correction_stats(prox, old, out.truncated))
    return out, stats


def _anchors(cfg: PPOActorConfig, mb: dict, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The old logprobs the ratio is taken against, and the proximal ones (decoupled PPO, else None).

    Without ``prox_logp`` in the batch and with :func:`prox_from_update`, this forward runs on
    the weights before the update, so its own logprobs (detached) are the proximal policy's.
    """
    old = mb["logprobs"].float()
    prox = mb.get("prox_logp")
    if prox is None and prox_from_update(cfg):
        prox = logp.detach().float()
    if not cfg.use_decoupled_loss:  # classic PPO: the ratio is against the recomputed logprobs, if any
        return (prox if cfg.recompute_logprob and prox is not None else old), None
    return old, None if prox is None else prox.float()


def _fused_surrogate(cfg: PPOActorConfig, head: LMHeadOutput, logp: torch.Tensor) -> bool:
    """Whether the surrogate runs as fused_ppo_loss's CUDA kernel.

    Only where that kernel runs (elsewhere fused_ppo_loss is ``losses.policy_loss`` itself), and
    for what it implements: per-token ratios (not GSPO) and token-mean aggregation (it returns
    a token sum, not per-sequence losses).
    """
    supported = cfg.importance_sampling_level == "token" and cfg.loss_agg_mode == "token-mean"
    supported = supported and cfg.rollout_correction.mode == "none" and cfg.loss in BUILTIN_LOSSES
    return supported and ppo_loss_backend(head.backend, logp) == "cuda"


def _fused_ppo_loss(head, mb, cfg, mask, logp, entropy, old, prox, top=None) -> torch.Tensor:
    """Token-mean loss with the surrogate from the fused epilogue and the penalties added in torch."""
    surrogate, stats = fused_ppo_loss(
        logp,
        old,
        mb["advantages"].float(),
        mask,
        prox_logprobs=None if prox is None else prox.float(),
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_higher,
        dual_clip=cfg.c_clip,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap if prox is not None else None,
        backend=head.backend,
    )
    penalties, kl = _add_penalties(torch.zeros_like(logp), cfg, mb, mask, logp, entropy, top)
    total, weight = losses.aggregate(penalties, mask, "token-mean")
    anchor = (prox if prox is not None else old).float()
    behav_weight = None if prox is None else torch.exp(prox.float() - old)
    # the epilogue counts clipped tokens per micro-batch: spreading each fraction over the
    # micro-batch's tokens keeps the tracker's token-weighted average exact
    surrogate_stats = {
        "importance_weight": torch.exp(logp.detach() - anchor),
        "clip_ratio": stats.clip_fraction.expand(mask.shape),
        "dual_clip_ratio": stats.dual_clip_fraction.expand(mask.shape),
        "capped_ratio": stats.behav_capped_fraction.expand(mask.shape),
    }
    if prox is not None:
        surrogate_stats.update(_correction_stats(prox, old, None))
    _record_stats(mask, logp, entropy, anchor, kl, behav_weight, surrogate_stats)
    return surrogate + total / weight.clamp(min=1)


def _correction_stats(prox: torch.Tensor, old: torch.Tensor, truncated: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The train/inference gap per token, and the tokens whose behaviour weight was truncated.

    The weight itself is ``behave_imp_weight`` and the masked fraction ``capped_ratio``.
    """
    gap = (prox.float() - old).abs()
    truncated = torch.zeros_like(gap) if truncated is None else truncated.float()
    return {"rollout_correction/abs_logp_diff": gap, "rollout_correction/truncated": truncated}


def policy_surrogate(cfg: PPOActorConfig):
    """The per-token surrogate of ``cfg.loss``: PPO's clipped one for a built-in name, else the user's function.

    A user's is called as :data:`~megarl.config.ppo.USER_LOSS_CALL` (``actor.loss_kwargs`` as its keywords);
    returns a :class:`losses.SurrogateOutput` and extra per-token stats (see :func:`user_surrogate`).
    """
    if cfg.loss in BUILTIN_LOSSES:
        return _clipped_surrogate
    return partial(user_surrogate, import_plugin(cfg.loss, "actor.loss"))


def _clipped_surrogate(logp, anchor, advantages, mask, *, cu_seqlens, config: PPOActorConfig):
    surrogate = losses.ppo_surrogate(
        logp,
        anchor,
        advantages,
        mask,
        eps_clip=config.eps_clip,
        eps_clip_higher=config.eps_clip_higher,
        c_clip=config.c_clip,
        importance_sampling_level=config.importance_sampling_level,
        cu_seqlens=cu_seqlens,
    )
    return surrogate, {}


def user_surrogate(fn, logp, anchor, advantages, mask, *, cu_seqlens, config: PPOActorConfig):
    """A user's loss, called as :data:`~megarl.config.ppo.USER_LOSS_CALL`: it returns the per-token loss
    [T], or ``(loss, {name: per-token stat})``.

    Its stats are logged beside the built-in ones (``ppo_actor/<name>``, averaged over loss tokens).
    """
    result = fn(logp, anchor, advantages, mask, cu_seqlens=cu_seqlens, config=config, **config.loss_kwargs)
    loss, stats = result if isinstance(result, tuple) else (result, {})
    if not isinstance(loss, torch.Tensor) or loss.shape != logp.shape:
        raise ValueError(
            f"actor.loss={config.loss!r} must return a per-token loss of shape {tuple(logp.shape)}, "
            f"got {getattr(loss, 'shape', type(loss).__name__)}"
        )
    none = torch.zeros_like(mask)
    ratio = torch.exp(logp.detach() - anchor)
    return losses.SurrogateOutput(loss, ratio, none, none), {k: v.detach().float() for k, v in stats.items()}


def _add_penalties(token_loss, cfg: PPOActorConfig, mb: dict, mask, logp, entropy, top: TeacherTopK | None = None):
    """``token_loss`` plus the KL-to-reference loss, minus the entropy bonus, plus the teacher's top-k forward
    KL (``top``: its gap term too where it has one); and the KL to the reference (or None)."""
    kl = None
    if cfg.kl_ctl > 0 and not cfg.kl_in_reward:
        kl = losses.kl_penalty(logp, mb["ref_logp"].float(), cfg.kl_estimator)
        token_loss = token_loss + cfg.kl_ctl * torch.where(mask, kl, torch.zeros_like(kl))
    if cfg.entropy_coeff > 0:
        token_loss = token_loss - cfg.entropy_coeff * torch.where(mask, entropy, torch.zeros_like(entropy))
    if top is not None:
        term = token_term(top, logp)
        if top.gap_term is not None:  # a chunk of the training path adds its gaps beside (megarl.actor.teacher_loss)
            term = term + top.gap_term
        token_loss = token_loss + cfg.teacher_coef * term
    return token_loss, kl


def _record_teacher_topk(top: TeacherTopK, mask, logp) -> None:
    """The forward KL from the teacher's top k per token, and the share of the teacher's probability they hold."""
    with torch.no_grad():
        kl = token_term(top, logp.detach().float()) + top.gap_term.detach()
        stats_tracker.denominator(teacher_topk_tokens=mask)
        stats_tracker.stat(denominator="teacher_topk_tokens", teacher_topk_kl=kl, teacher_topk_mass=top.q.sum(-1))


def _record_stats(mask, logp, entropy, anchor, kl, behav_weight, surrogate_stats: dict) -> None:
    """Per-token statistics into the stats tracker (on the last pipeline stage, no host sync)."""
    stats_tracker.denominator(n_tokens=mask)
    stats = {
        "entropy": entropy.detach().float(),
        "approx_kl": (logp.detach() - anchor.float()),
        "new_logp": logp.detach(),
        **surrogate_stats,
    }
    if behav_weight is not None:
        stats["behave_imp_weight"] = behav_weight.float()
    if kl is not None:
        stats["kl_to_ref"] = kl.detach().float()
    stats_tracker.stat(denominator="n_tokens", **stats)
