"""MegatronPPOActor: compute_logp, compute_advantages and ppo_update on the Megatron engine.

The walkthrough's FSDPPPOActor rebuilt on :class:`~megarl.actor.engine.MegatronEngine`;
the losses and advantage estimators are the pure functions of ``megarl.actor.losses`` and
``megarl.actor.advantages``. One training step reads::

    if actor.needs_prox_pass():                        # recompute_logprob, several mini-batches or epochs
        batch["prox_logp"] = actor.compute_logp(batch)
    batch["ref_logp"] = ref.compute_logp(batch)        # kl_ctl > 0
    actor.compute_advantages(batch)
    stats = actor.ppo_update(batch)                    # rows of zero advantage cost nothing (skip_zero_advantage)
    actor.step_lr_scheduler()

Alignment (as AReaL): the rollout's ``loss_mask`` / ``logprobs`` refer to token ``t`` at
position ``t``; ``compute_logp`` returns at position ``t`` the logprob of token ``t + 1``
given the prefix. ``compute_advantages`` rolls ``loss_mask`` and ``logprobs`` by one so that
every per-token tensor of the batch uses the latter (next-token) alignment from then on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from functools import partial

import torch

from megarl.actor import advantages as adv_fns
from megarl.actor import losses
from megarl.actor.engine import MegatronEngine
from megarl.actor.fused_ppo_loss import fused_ppo_loss, ppo_loss_backend
from megarl.actor.gap import GapMeter, version_lag
from megarl.actor.lm_head import LMHeadOutput
from megarl.actor.routing import RoutingMeter, add_server_routing
from megarl.config.train import BUILTIN_LOSSES, PPOActorConfig
from megarl.kernels import PATH_CODES, Truncation, logprobs_backend
from megarl.utils import stats_tracker
from megarl.utils.plugins import import_plugin

logger = logging.getLogger(__name__)


class MegatronPPOActor(MegatronEngine):
    """The policy: a MegatronEngine with the PPO / GRPO algorithm on top."""

    def __init__(self, config: PPOActorConfig):
        super().__init__(config)
        self.config: PPOActorConfig = config
        self.gap = GapMeter()

    def compute_logp(
        self, data: dict, temperature: float | None = None, truncation: Truncation | None = None
    ) -> torch.Tensor:
        """Next-token logprobs ``[B, S]`` of the current weights at the sampling temperature, under the
        sampling's truncation (:func:`replayed_truncation`) unless ``truncation`` is given."""
        temperature = self.config.temperature if temperature is None else temperature
        truncation = replayed_truncation(self.config) if truncation is None else truncation
        return super().compute_logp(data, temperature, truncation)

    def needs_prox_pass(self) -> bool:
        """Whether the proximal logprobs need a forward pass of their own before ``ppo_update``.

        Not when the update's own forward already sees the proximal policy (the weights
        before the update): one mini-batch and one epoch, so that forward is the first and
        only one. ``ppo_update`` then takes them from it, detached (verl does the same for
        on-policy mini-batches): the same loss and gradients, one forward pass fewer.
        """
        return _uses_prox(self.config) and not prox_from_update(self.config)

    @torch.no_grad()
    def compute_advantages(self, data: dict) -> None:
        """Advantages in place; rolls ``loss_mask`` / ``logprobs`` to next-token alignment.

        GRPO's group-normalised rewards, or with ``data["values"]`` (a critic's
        :meth:`~megarl.actor.critic.MegatronCritic.compute_values`) GAE, which also adds the
        ``returns`` the critic regresses on. Adds ``advantages``, ``kl_rewards``, ``tot_rewards``
        and (decoupled PPO) ``prox_logp``; and for the train–inference gap (:mod:`megarl.actor.gap`)
        ``behaviour_logp``, ``version_lag`` and, when the pool stamped the episodes' servers, ``token_server``.
        """
        cfg = self.config
        batch_size, seq_len = data["attention_mask"].shape
        cu_seqlens = torch.arange(batch_size + 1, dtype=torch.int64) * seq_len
        loss_mask = torch.roll(data["loss_mask"], shifts=-1, dims=-1).bool() & data["attention_mask"].bool()
        old_logp = torch.roll(data["logprobs"].float(), shifts=-1, dims=-1)
        data["behaviour_logp"] = old_logp * loss_mask  # the servers' logprobs, kept for the gap
        data["version_lag"] = version_lag(data, loss_mask, self.get_version())
        add_server_routing(data, loss_mask)  # MoE: the servers' routed experts, when they reported them
        if "server_index" in data:
            data["token_server"] = data["server_index"].long()[:, None].expand(batch_size, seq_len).contiguous()
        if "prox_logp" not in data and not prox_from_update(cfg):
            if _uses_prox(cfg):
                raise ValueError("ppo_update needs data['prox_logp'] (actor.compute_logp): see needs_prox_pass()")
            if cfg.use_decoupled_loss:
                data["prox_logp"] = old_logp.clone()  # on-policy: proximal == behaviour
        if cfg.recompute_logprob and not cfg.use_decoupled_loss and "prox_logp" in data:
            old_logp = data["prox_logp"].float()  # classic PPO on recomputed logprobs
        rewards = adv_fns.shape_rewards(data["rewards"].float(), cfg.reward_bias, cfg.reward_scaling, cfg.reward_clip)
        kl_rewards = torch.zeros_like(old_logp)
        if cfg.kl_ctl > 0 and cfg.kl_in_reward:
            if "ref_logp" not in data:
                raise ValueError(
                    "kl_in_reward with kl_ctl > 0 needs data['ref_logp'] (a reference model's compute_logp)"
                )
            policy_logp = data.get("prox_logp", old_logp)
            kl_rewards = -cfg.kl_ctl * losses.kl_penalty(policy_logp, data["ref_logp"].float(), cfg.kl_estimator)
            kl_rewards = kl_rewards * loss_mask
        kl_token_rewards = kl_rewards.flatten() if cfg.kl_in_reward and cfg.kl_ctl > 0 else None
        norm = cfg.adv_norm
        if "values" in data:  # PPO with a critic: GAE over the token rewards and the critic's values
            advantages, returns = adv_fns.gae_advantages(
                rewards,
                data["values"].flatten(),
                loss_mask.flatten(),
                cu_seqlens,
                cfg.group_size,
                gamma=cfg.discount,
                lam=cfg.gae_lambda,
                mean_level=norm.mean_level,
                std_level=norm.std_level,
                eps=norm.eps,
                kl_token_rewards=kl_token_rewards,
            )
            data["returns"] = returns.view(batch_size, seq_len)
            data["values"] = data["values"].float() * loss_mask
        else:
            advantages = adv_fns.grpo_advantages(
                rewards,
                loss_mask.flatten(),
                cu_seqlens,
                cfg.group_size,
                mean_level=norm.mean_level,
                std_level=norm.std_level,
                leave_one_out=norm.mean_leave1out,
                eps=norm.eps,
                kl_token_rewards=kl_token_rewards,
                gamma=cfg.discount,
            )
        data["advantages"] = advantages.view(batch_size, seq_len)
        data["loss_mask"] = loss_mask.to(torch.int32)
        data["logprobs"] = old_logp * loss_mask
        data["kl_rewards"] = kl_rewards
        data["tot_rewards"] = rewards

    def ppo_update(self, data: dict) -> list[dict[str, float]]:
        """``ppo_n_epochs`` passes over ``ppo_n_minibatches`` mini-batches; one stats dict per step."""
        cfg = self.config
        if cfg.kl_ctl > 0 and not cfg.kl_in_reward and "ref_logp" not in data:
            raise ValueError("a KL loss (kl_ctl > 0, kl_in_reward False) needs data['ref_logp']")
        norm_len = cfg.dr_grpo_norm_len or data["attention_mask"].shape[1]
        loss_fn = partial(ppo_loss, cfg=cfg, norm_len=norm_len, surrogate_fn=policy_surrogate(cfg))  # resolved once
        weight_fn = partial(ppo_loss_weight, mode=cfg.loss_agg_mode)
        all_stats = []
        for epoch in range(cfg.ppo_n_epochs):
            for i, minibatch in enumerate(split_minibatches(data, cfg.ppo_n_minibatches, cfg.group_size)):
                with stats_tracker.scope("ppo_actor"):
                    first = epoch == 0 and i == 0
                    gap = self._gap_meter(data, first)
                    with self._routing_meter(minibatch, first):
                        step = self.train_minibatch(minibatch, partial(loss_fn, gap=gap), weight_fn)
                    keys = ("loss", "grad_norm", "lr", "update_successful", "n_mbs", "packed_tokens", "skipped_seqs")
                    stats_tracker.scalar(**{k: step[k] for k in keys})
                    # 90 / 80: the sm90 / sm80 CUDA mainloop (verified by its self-check), 0: torch
                    stats_tracker.scalar(fused_kernel_path=PATH_CODES[self.fused_kernel_path()])
                    self.gap.finish(self.parallel.dp_group)
                all_stats.append(stats_tracker.export())
        return all_stats

    def _gap_meter(self, data: dict, first: bool) -> GapMeter | None:
        """The gap meter where the trainer's logprobs are the weights' before the update: the recomputed
        ones, or the update's own forward for the first mini-batch of the first epoch (``first``)."""
        if "behaviour_logp" not in data or (not first and "prox_logp" not in data):
            return None
        return self.gap

    @contextlib.contextmanager
    def _routing_meter(self, minibatch: dict, first: bool):
        """MoE routing agreement with the servers (:mod:`megarl.actor.routing`), measured on the first
        mini-batch's forward (the weights before the update) when the servers reported their routing."""
        if not first or "server_routing" not in minibatch:
            yield
            return
        meter = RoutingMeter(self.parallel.tp_rank, self.parallel.alloc.tp)
        self.routing_meter = meter
        try:
            with meter.watching(self.model):
                yield
        finally:
            self.routing_meter = None
        meter.finish()

    def train_minibatch(self, minibatch: dict, loss_fn, weight_fn) -> dict[str, float]:
        """One optimizer step on ``minibatch``, without the rows whose loss is zero (``skip_zero_advantage``)."""
        active, inert_weight, n_inert = self.drop_inert_rows(minibatch, weight_fn)
        step = self.train_batch(active, loss_fn, weight_fn, extra_weight=inert_weight)
        return {**step, "skipped_seqs": float(n_inert)}

    def drop_inert_rows(self, minibatch: dict, weight_fn) -> tuple[dict | None, float, int]:
        """``minibatch`` without its inert rows (see :func:`inert_rows`), their loss weight, their count.

        The rows come back as None when no data-parallel rank has a row left (a batch with nothing
        to learn). A rank whose rows are all inert while others have work runs its shortest row
        with an empty loss mask, so that every rank runs the same schedule.
        """
        if not _drops_inert_rows(self.config):  # the same config on every rank: no collective needed
            return minibatch, 0.0, 0
        inert = inert_rows(minibatch, self.config)
        (anyone_active,) = self._all_reduce_max([int(not inert.all())])  # on every DP rank, always
        if not inert.any():
            return minibatch, 0.0, 0
        n_rows, n_inert = len(inert), int(inert.sum())
        weight = float(weight_fn(padded_as_packed(_rows(minibatch, _where(inert), n_rows))))
        if not anyone_active:
            return None, weight, n_inert
        if n_inert == n_rows:
            placeholder = _rows(minibatch, [int(minibatch["attention_mask"].sum(-1).argmin())], n_rows)
            placeholder["loss_mask"] = torch.zeros_like(placeholder["loss_mask"])
            return placeholder, weight, n_inert
        return _rows(minibatch, _where(~inert), n_rows), weight, n_inert


def inert_rows(data: dict, cfg: PPOActorConfig) -> torch.Tensor:
    """[B] bool: rows whose loss and gradient are exactly zero, so the update can leave them out.

    The clipped surrogate of a token is ``-A * ratio`` (times the behaviour weight), zero with
    its gradient wherever the advantage ``A`` is 0; a KL loss or an entropy bonus would still
    pull on such a row, so then no row is inert.
    """
    if not _drops_inert_rows(cfg):
        return torch.zeros(data["attention_mask"].shape[0], dtype=torch.bool)
    return ~((data["advantages"] != 0) & data["loss_mask"].bool()).any(-1)


def _drops_inert_rows(cfg: PPOActorConfig) -> bool:
    """``skip_zero_advantage``, unless a KL loss or an entropy bonus pulls on every row.

    A user's loss (``actor.loss`` a function) may too, so its rows are all trained on.
    """
    loss_terms = (cfg.kl_ctl > 0 and not cfg.kl_in_reward) or cfg.entropy_coeff > 0
    return cfg.skip_zero_advantage and not loss_terms and cfg.loss in BUILTIN_LOSSES


def padded_as_packed(data: dict) -> dict:
    """The loss-weight view of right-padded ``[B, S]`` rows: what :func:`ppo_loss_weight` reads of a micro-batch.

    ``label_mask`` marks the tokens that have a next token in their row, as packing does.
    """
    rows, width = data["loss_mask"].shape
    has_next = torch.arange(width)[None, :] < data["attention_mask"].sum(-1, keepdim=True) - 1
    return {
        "loss_mask": data["loss_mask"].flatten().bool(),
        "label_mask": has_next.flatten(),
        "cu_seqlens": torch.arange(rows + 1) * width,
    }


def _uses_prox(cfg: PPOActorConfig) -> bool:
    """Whether the loss anchors on the current policy's logprobs before the update (proximal policy)."""
    return cfg.recompute_logprob or cfg.use_decoupled_loss


def prox_from_update(cfg: PPOActorConfig) -> bool:
    """Whether ``ppo_update``'s forward gives the proximal logprobs (see ``needs_prox_pass``).

    A KL reward (``kl_in_reward``) needs them earlier, in ``compute_advantages``.
    """
    kl_reward = cfg.kl_ctl > 0 and cfg.kl_in_reward
    return _uses_prox(cfg) and cfg.ppo_n_minibatches == 1 and cfg.ppo_n_epochs == 1 and not kl_reward


def split_minibatches(data: dict, n: int, group_size: int = 1) -> list[dict]:
    """``n`` contiguous row chunks of ``data``, cut on group boundaries (whole GRPO groups)."""
    rows = data["attention_mask"].shape[0]
    groups = max(rows // group_size, 1)
    if n > groups:
        raise ValueError(f"ppo_n_minibatches={n} exceeds the {groups} groups of {group_size} in a batch of {rows}")
    bounds = [round(i * groups / n) * group_size for i in range(n)] + [rows]
    return [_rows(data, list(range(a, b)), rows) for a, b in itertools.pairwise(bounds)]


def _rows(data: dict, rows: list[int], n_rows: int) -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n_rows:
            out[key] = value[rows]
        elif isinstance(value, list) and len(value) == n_rows:
            out[key] = [value[r] for r in rows]
        else:
            out[key] = value
    return out


def _where(rows: torch.Tensor) -> list[int]:
    return rows.nonzero().flatten().tolist()


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
    ``gap``: records the train–inference gap of the micro-batch's tokens when given.
    """
    mask = _mask(mb)
    truncation = replayed_truncation(cfg)
    if _grads_in_forward(cfg, head):
        return _ppo_loss_grads_in_forward(head, mb, cfg, norm_len, mask, gap, truncation)
    logp, entropy, outside = head.logprobs_entropy(
        mb["labels"], cfg.temperature, where=mask, truncation=truncation, return_outside=True
    )  # no head work on prompts
    _record_truncation(truncation, mask, outside)
    return _loss_of_logprobs(head, mb, cfg, norm_len, mask, logp, entropy, surrogate_fn, gap)


def _record_truncation(truncation: Truncation | None, mask: torch.Tensor, outside: torch.Tensor) -> None:
    """The share of the micro-batch's tokens whose label fell below its truncation threshold."""
    if truncation is not None:
        stats_tracker.denominator(**{"truncation/n_tokens": mask})
        stats_tracker.stat(denominator="truncation/n_tokens", **{"truncation/label_outside": outside.float()})


def replayed_truncation(cfg: PPOActorConfig) -> Truncation | None:
    """The sampling's top-k / top-p / min-p the trainer replays (``actor.replay_truncation``); None: none."""
    truncation = Truncation(top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
    return truncation if cfg.replay_truncation and truncation.active else None


def _loss_of_logprobs(head, mb, cfg, norm_len, mask, logp, entropy, surrogate_fn, gap) -> torch.Tensor:
    """The loss of :func:`ppo_loss` from the micro-batch's logprobs and entropies; records the stats."""
    old, prox = _anchors(cfg, mb, logp)
    if gap is not None:
        gap.record(mb, mb["prox_logp"] if "prox_logp" in mb else logp, mask)
    fused = _fused_surrogate(cfg, head, logp)
    logger.debug(
        "ppo_loss: logprobs on the %s path, surrogate via %s",
        logprobs_backend(head.backend, head.hidden, head.weight),
        "fused_ppo_loss" if fused else "losses.policy_loss",
    )
    if fused:
        return _fused_ppo_loss(head, mb, cfg, mask, logp, entropy, old, prox)
    cu_seqlens = mb["cu_seqlens"].long()
    surrogate_fn = surrogate_fn or policy_surrogate(cfg)
    out, surrogate_stats = _policy_loss(cfg, surrogate_fn, mb, mask, logp, old, prox, cu_seqlens)
    token_loss, kl = _add_penalties(out.loss, cfg, mb, mask, logp, entropy)
    total, weight = losses.aggregate(token_loss, mask, cfg.loss_agg_mode, cu_seqlens, norm_len)
    _record_stats(mask, logp, entropy, prox if prox is not None else old, kl, out.behav_weight, surrogate_stats)
    return total / weight.clamp(min=1)


def _grads_in_forward(cfg: PPOActorConfig, head: LMHeadOutput) -> bool:
    """Whether :func:`ppo_loss` takes the training path (the head's gradients computed in its forward).

    Where the fused kernels run (the logprobs' CUDA path) and the loss is a sum of per-token terms
    of (logprob, entropy): a built-in surrogate with per-token ratios and no sequence-level
    rollout correction (any aggregation: it only weighs the tokens).
    """
    per_token = cfg.importance_sampling_level == "token" and cfg.rollout_correction.mode == "none"
    per_token = per_token and cfg.loss in BUILTIN_LOSSES
    return per_token and logprobs_backend(head.backend, head.hidden, head.weight) == "cuda"


def _token_weights(mask: torch.Tensor, cfg: PPOActorConfig, cu_seqlens: torch.Tensor, norm_len: int) -> torch.Tensor:
    """d loss / d token_loss ``[T]`` of the aggregation (linear in the per-token loss)."""
    x = torch.zeros(mask.shape, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        total, weight = losses.aggregate(x, mask, cfg.loss_agg_mode, cu_seqlens, norm_len)
    (coeff,) = torch.autograd.grad(total, x)
    return coeff / weight.detach().clamp(min=1)


def _ppo_loss_grads_in_forward(head, mb, cfg, norm_len, mask, gap, truncation=None) -> torch.Tensor:
    """:func:`ppo_loss` on the training path: the same loss, its gradient made chunk by chunk in the
    head's forward (``LMHeadOutput.token_loss``; ``truncation``: of the replayed sampling
    distribution, the threshold from each chunk's logits), and the same statistics (from the
    detached logprobs)."""
    logger.debug("ppo_loss: training path (grads in the head's forward), surrogate via losses.policy_loss")
    rows = mask.nonzero().squeeze(-1)  # the head's rows
    coeff = _token_weights(mask, cfg, mb["cu_seqlens"].long(), norm_len)[rows]
    keys = [k for k in ("logprobs", "prox_logp", "ref_logp", "advantages") if k in mb]
    sub = {k: mb[k][rows] for k in keys}

    def terms(t0, t1, logp, entropy):
        chunk = {k: v[t0:t1] for k, v in sub.items()}
        on = torch.ones(logp.shape, dtype=torch.bool, device=logp.device)
        old, prox = _anchors(cfg, chunk, logp)
        out, _ = _policy_loss(cfg, _clipped_surrogate, chunk, on, logp, old, prox, None)
        token_loss, _ = _add_penalties(out.loss, cfg, chunk, on, logp, entropy)
        return token_loss * coeff[t0:t1]

    loss, logp, entropy, outside = head.token_loss(
        mb["labels"], terms, cfg.temperature, where=mask, truncation=truncation, return_outside=True
    )
    _record_truncation(truncation, mask, outside)
    with torch.no_grad():  # statistics only
        _loss_of_logprobs(head, mb, cfg, norm_len, mask, logp, entropy, policy_surrogate(cfg), gap)
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


def _fused_ppo_loss(head, mb, cfg, mask, logp, entropy, old, prox) -> torch.Tensor:
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
    penalties, kl = _add_penalties(torch.zeros_like(logp), cfg, mb, mask, logp, entropy)
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

    A user's is called as :data:`~megarl.config.train.USER_LOSS_CALL` (``actor.loss_kwargs`` as its keywords);
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
    """A user's loss, called as :data:`~megarl.config.train.USER_LOSS_CALL`: it returns the per-token loss
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


def _add_penalties(token_loss, cfg: PPOActorConfig, mb: dict, mask, logp, entropy):
    """``token_loss`` plus the KL-to-reference loss and minus the entropy bonus; and the KL (or None)."""
    kl = None
    if cfg.kl_ctl > 0 and not cfg.kl_in_reward:
        kl = losses.kl_penalty(logp, mb["ref_logp"].float(), cfg.kl_estimator)
        token_loss = token_loss + cfg.kl_ctl * torch.where(mask, kl, torch.zeros_like(kl))
    if cfg.entropy_coeff > 0:
        token_loss = token_loss - cfg.entropy_coeff * torch.where(mask, entropy, torch.zeros_like(entropy))
    return token_loss, kl


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
