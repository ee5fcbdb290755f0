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
from functools import partial

import torch

from megarl.actor import advantages as adv_fns
from megarl.actor import losses
from megarl.actor.engine import MegatronEngine, export_stats
from megarl.actor.gap import GapMeter, version_lag
from megarl.actor.moe_routing import RoutingMeter, RoutingReplay, add_server_routing
from megarl.actor.ppo_loss import (  # the loss of one micro-batch; its public names also load from here
    _uses_prox,
    policy_surrogate,
    ppo_loss,
    ppo_loss_weight,
    prox_from_update,
    replayed_truncation,
    user_surrogate,
)
from megarl.actor.schedule import all_reduce_max
from megarl.actor.teacher_loss import TOPK_KEYS, in_batch
from megarl.config.ppo import BUILTIN_LOSSES, PPOActorConfig
from megarl.kernels import PATH_CODES, Truncation
from megarl.utils import stats_tracker

__all__ = [
    "MegatronPPOActor",
    "inert_rows",
    "padded_as_packed",
    "policy_surrogate",
    "ppo_loss",
    "ppo_loss_weight",
    "prox_from_update",
    "replayed_truncation",
    "split_minibatches",
    "user_surrogate",
]


SERVER_CALLS = ("connect_engine", "prepare_batch", "update_weights")
"""AReaL's actor calls that reach the servers: :class:`megarl.run.actor.PPOActor` has them (a floor above this
one), not this actor."""


class MegatronPPOActor(MegatronEngine):
    """The policy: a MegatronEngine with the PPO / GRPO algorithm on top."""

    def __init__(self, config: PPOActorConfig):
        super().__init__(config)
        self.config: PPOActorConfig = config
        self.gap = GapMeter()
        self.routing_replay: RoutingReplay | None = None  # built by initialize() with actor.routing_replay

    def __getattr__(self, name: str):
        """Only for names not found otherwise: the server calls point to the actor that has them."""
        if name in SERVER_CALLS:
            raise AttributeError(server_call_moved(type(self).__name__, name))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def initialize(self, addr: str | None = None, ft_spec=None, parallel=None) -> None:
        super().initialize(addr, ft_spec, parallel)
        if self.config.routing_replay != "none":  # MoE routing replay (megarl.actor.moe_routing)
            p, t = self.parallel, self.tconfig
            checkpointed = t.recompute_granularity == "full"
            self.routing_replay = RoutingReplay(
                self.config.routing_replay, self.model, p.tp_rank, p.tp_group, t.sequence_parallel, checkpointed
            )
            self.microbatch_hooks.append(self.routing_replay)

    def compute_logp(
        self, data: dict, temperature: float | None = None, truncation: Truncation | None = None
    ) -> torch.Tensor:
        """Next-token logprobs ``[B, S]`` of the current weights at the sampling temperature, under the
        sampling's truncation (:func:`replayed_truncation`) unless ``truncation`` is given.

        With ``routing_replay``: R3 routes the tokens as the servers did; R2 records this pass's
        routing in ``data["replay_routes"]`` for ``ppo_update`` to replay."""
        temperature = self.config.temperature if temperature is None else temperature
        truncation = replayed_truncation(self.config) if truncation is None else truncation
        replay = self.routing_replay.proximal_pass(data) if self.routing_replay else contextlib.nullcontext()
        with replay:
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

        ``actor.adv_estimator`` picks the estimator (``advantages.ADVANTAGE_ESTIMATORS``): GRPO's
        group-normalised rewards, or GAE over ``data["values"]`` (a critic's
        :meth:`~megarl.actor.critic.MegatronCritic.compute_values`), which also adds the
        ``returns`` the critic regresses on. Once per batch: it aligns the batch in place. Adds ``advantages``, ``kl_rewards``, ``tot_rewards``
        (with a teacher's ``teacher_logp``, its servers' or the trainer's: its term and ``teacher_reverse_kl``; with
        its top k, ``teacher.top_k``, those are rolled as ``logprobs`` and the term is the loss's, not the advantages')
        and (decoupled PPO) ``prox_logp``; and for the train–inference gap (:mod:`megarl.actor.gap`)
        ``behaviour_logp``, ``version_lag`` and, when the pool stamped the episodes' servers, ``token_server``.
        """
        cfg = self.config
        _check_advantage_inputs(data, cfg.adv_estimator)
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
        values = data["values"].flatten() if "values" in data else None
        estimate = adv_fns.ADVANTAGE_ESTIMATORS[cfg.adv_estimator]
        group = self.parallel.data_group if self.parallel is not None else None  # batch-level statistics
        advantages, returns = estimate(rewards, values, loss_mask.flatten(), cu_seqlens, cfg, kl_token_rewards, group)
        if "teacher_logp" in data:  # on-policy distillation: the teacher scored every token
            teacher_logp = torch.roll(data["teacher_logp"].float(), shifts=-1, dims=-1)
            term, reverse_kl = adv_fns.teacher_advantages(
                data.get("prox_logp", old_logp).flatten(),
                teacher_logp.flatten(),
                loss_mask.flatten(),
                cu_seqlens,
                cfg.teacher_coef,
                cfg.teacher_discount,
            )
            if not in_batch(data):  # with the teacher's top k, its term is the loss's (megarl.actor.teacher_loss)
                advantages = advantages + term
            data["teacher_reverse_kl"] = reverse_kl.view(batch_size, seq_len)
        for key in TOPK_KEYS:
            if key in data:
                data[key] = torch.roll(data[key], shifts=-1, dims=1)
        if returns is not None:  # the critic regresses on them
            data["returns"] = returns.view(batch_size, seq_len)
            data["values"] = data["values"].float() * loss_mask
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
        norm_len = cfg.dr_grpo_norm_len or self._batch_width(data)
        loss_fn = partial(ppo_loss, cfg=cfg, norm_len=norm_len, surrogate_fn=policy_surrogate(cfg))  # resolved once
        weight_fn = partial(ppo_loss_weight, mode=cfg.loss_agg_mode)
        all_stats = []
        replay = self.routing_replay.update(data) if self.routing_replay else contextlib.nullcontext()
        with replay:
            for epoch, i, minibatch in self._minibatches(data):
                with stats_tracker.scope("ppo_actor"):
                    first = epoch == 0 and i == 0
                    gap = self._gap_meter(data, first)
                    with self._routing_meter(minibatch, first):
                        step = self.train_minibatch(minibatch, partial(loss_fn, gap=gap), weight_fn)
                    if self.routing_replay:
                        self.routing_replay.finish()
                    keys = ("loss", "grad_norm", "lr", "update_successful", "n_mbs", "packed_tokens", "skipped_seqs")
                    stats_tracker.scalar(**{k: step[k] for k in keys})
                    # 90 / 80: the sm90 / sm80 CUDA mainloop (verified by its self-check), 0: torch
                    stats_tracker.scalar(fused_kernel_path=PATH_CODES[self.fused_kernel_path()])
                    self.gap.finish(self.parallel.dp_group)
                all_stats.append(export_stats(self.parallel))
        return all_stats

    def _batch_width(self, data: dict) -> int:
        """The padded length of the whole batch: the longest of the data-parallel shares' (Dr. GRPO's
        constant divisor when ``dr_grpo_norm_len`` is null, the same on every rank)."""
        width = data["attention_mask"].shape[1]
        return width if self.parallel is None else all_reduce_max([width], self.parallel)[0]

    def _minibatches(self, data: dict):
        """``(epoch, index, mini-batch)``: ``ppo_n_epochs`` passes over ``ppo_n_minibatches`` mini-batches."""
        cfg = self.config
        for epoch in range(cfg.ppo_n_epochs):
            for i, minibatch in enumerate(split_minibatches(data, cfg.ppo_n_minibatches, cfg.group_size)):
                yield epoch, i, minibatch

    def _gap_meter(self, data: dict, first: bool) -> GapMeter | None:
        """The gap meter where the trainer's logprobs are the weights' before the update: the recomputed
        ones, or the update's own forward for the first mini-batch of the first epoch (``first``)."""
        if "behaviour_logp" not in data or (not first and "prox_logp" not in data):
            return None
        return self.gap

    @contextlib.contextmanager
    def _routing_meter(self, minibatch: dict, first: bool):
        """MoE routing agreement with the servers (:mod:`megarl.actor.moe_routing`), measured on the first
        mini-batch's forward (the weights before the update) when the servers reported their routing."""
        if not first or "server_routing" not in minibatch:
            yield
            return
        meter = RoutingMeter(self.parallel.tp_rank, self.parallel.alloc.tp)
        self.microbatch_hooks.append(meter)
        try:
            with meter.watching(self.model):
                yield
        finally:
            self.microbatch_hooks.remove(meter)
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
        (anyone_active,) = all_reduce_max([int(not inert.all())], self.parallel)  # on every DP rank, always
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


def _check_advantage_inputs(data: dict, estimator: str) -> None:
    """A ValueError when ``compute_advantages`` cannot estimate on ``data``: already done (its tensors are
    next-token aligned now), or values missing for GAE / given to GRPO (a critic the config does not use)."""
    if "behaviour_logp" in data:  # what compute_advantages adds when it aligns a batch
        raise ValueError(
            "compute_advantages: this batch went through compute_advantages already (its loss_mask and "
            "logprobs are next-token aligned); call it once per batch"
        )
    if (estimator == "gae") != ("values" in data):
        raise ValueError(
            f"compute_advantages: actor.adv_estimator={estimator!r} "
            + ("needs data['values'] (a critic's compute_values)" if estimator == "gae" else "takes no data['values']")
        )


def inert_rows(data: dict, cfg: PPOActorConfig) -> torch.Tensor:
    """[B] bool: rows whose loss and gradient are exactly zero, so the update can leave them out.

    The clipped surrogate of a token is ``-A * ratio`` (times the behaviour weight), zero with
    its gradient wherever the advantage ``A`` is 0; a KL loss, an entropy bonus or the teacher's
    top-k term would still pull on such a row, so then no row is inert.
    """
    if not _drops_inert_rows(cfg) or in_batch(data):
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


def server_call_moved(actor: str, call: str) -> str:
    """Why ``actor`` has no ``call`` (one of :data:`SERVER_CALLS`), and which actor to build instead."""
    return (
        f"{actor} has no {call}(): it stands below the servers. AReaL's calls that reach them "
        f"({', '.join(SERVER_CALLS)}) are on megarl.run.actor.PPOActor, this actor with the weight sync and "
        "the rollout batches, whose other calls are the same: build it instead, "
        "`from megarl.run.actor import PPOActor; actor = PPOActor(config=config.actor)` "
        "(docs/name-mapping.md, AReaL's imports and calls)"
    )
