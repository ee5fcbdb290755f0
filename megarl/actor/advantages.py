"""Rewards to advantages: reward shaping, GRPO group normalisation, GAE.

Sequences arrive grouped: ``group_size`` consecutive sequences answer the same
prompt (the rollout side keeps groups contiguous and the coordinator splits the
batch on group boundaries). Tensors are packed token tensors [T] with
``cu_seqlens`` [N+1], as in :mod:`megarl.actor.losses`.

Each data-parallel rank holds a share of the batch: statistics at the ``batch`` level are sums
all-reduced over ``group`` (the data-parallel group without context parallelism), so the
advantages do not depend on the data-parallel size. Group-level statistics need no
communication: a group never spans two ranks.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from megarl.actor import cpu_shim
from megarl.actor.segments import sequence_ids

NormLevel = Literal["group", "batch", "none"]


def shape_rewards(rewards: torch.Tensor, bias: float, scaling: float, clip: float) -> torch.Tensor:
    """``clip((r + bias) * scaling, -clip, clip)`` per sequence."""
    return ((rewards + bias) * scaling).clamp(-clip, clip)


def normalize_rewards(
    rewards: torch.Tensor,
    group_size: int,
    mean_level: NormLevel = "group",
    std_level: NormLevel = "group",
    leave_one_out: bool = False,
    eps: float = 1e-5,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """GRPO-style normalisation of per-sequence rewards [N] → advantages [N].

    ``mean_level``/``std_level`` pick the statistics' scope (each prompt's group or the
    whole batch, over the data-parallel ``group``'s shares); ``none`` skips that step (Dr.GRPO:
    ``std_level="none"``). With ``leave_one_out`` the baseline of a sample is the mean of the
    *other* samples of its scope (RLOO), which keeps the estimator unbiased. The std is the
    population std.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of group_size={group_size}")
    rewards = rewards.float()
    adv = rewards
    if mean_level != "none":
        total, count = _scope_sums(rewards, group_size, mean_level, group)
        if not leave_one_out:
            adv = adv - total / count
        elif int(count.min()) < 2:
            raise ValueError("leave-one-out baselines need at least 2 samples per scope")
        else:
            adv = adv - (total - rewards) / (count - 1)
    if std_level != "none":
        total, count = _scope_sums(rewards, group_size, std_level, group)
        squares, _ = _scope_sums((rewards - total / count).square(), group_size, std_level, group)
        adv = adv / ((squares / count).sqrt() + eps)
    return adv


def _scope_sums(
    values: torch.Tensor, group_size: int, level: NormLevel, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] sum of the ``values`` of each one's scope, and the scope's size (its group, or the whole batch)."""
    if level == "group":
        sums = values.view(-1, group_size).sum(dim=1, keepdim=True).expand(-1, group_size).reshape(-1)
        return sums, torch.full_like(values, group_size)
    if level == "batch":
        total = batch_sum(torch.stack([values.sum(), torch.tensor(float(values.numel()))]), group)
        return total[0].expand_as(values), total[1].expand_as(values)
    raise ValueError(f"unknown normalisation level {level!r}; expected 'group', 'batch' or 'none'")


def batch_sum(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``local`` summed over the data-parallel ranks of ``group`` (each holding a share of the batch)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    total = local.to(cpu_shim.device(), copy=True)  # NCCL reduces device tensors
    dist.all_reduce(total, group=group)
    return total.to(local.device)


def broadcast_to_tokens(per_sequence: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[N] → [T]: every token carries its sequence's value."""
    return per_sequence[sequence_ids(cu_seqlens, total)]


def last_token_mask(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] bool: the last loss-masked token of each sequence (where the outcome reward lands)."""
    positions = torch.arange(loss_mask.numel(), device=loss_mask.device)
    marked = torch.where(loss_mask.bool(), positions, torch.full_like(positions, -1))
    seq = sequence_ids(cu_seqlens, loss_mask.numel())
    last = torch.full((len(cu_seqlens) - 1,), -1, dtype=positions.dtype, device=positions.device)
    last = last.scatter_reduce(0, seq, marked, reduce="amax")
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    out[last[last >= 0]] = True
    return out


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation within each sequence, over loss-masked tokens.

    ``values`` None means a zero critic (then GAE with lambda 1 is the return-to-go).
    Returns (advantages [T], returns [T]), zero outside the mask. The recursion runs
    over token positions, vectorised across sequences.
    """
    mask = loss_mask.bool()
    values = torch.zeros_like(token_rewards) if values is None else values
    rewards_nl, where = _to_rows(token_rewards.float(), mask, cu_seqlens)  # [N, L]
    values_nl, _ = _to_rows(values.float(), mask, cu_seqlens)
    next_values = torch.nn.functional.pad(values_nl[:, 1:], (0, 1))  # [N, L], 0 after the last token
    running = torch.zeros(rewards_nl.shape[0], dtype=torch.float32, device=rewards_nl.device)
    adv_nl = torch.zeros_like(rewards_nl)
    for t in reversed(range(rewards_nl.shape[1])):
        delta = rewards_nl[:, t] + gamma * next_values[:, t] - values_nl[:, t]
        running = delta + gamma * lam * running
        adv_nl[:, t] = running
    advantages = torch.zeros_like(token_rewards, dtype=torch.float32)
    advantages[where[0]] = adv_nl[where[1], where[2]]
    return advantages, torch.where(mask, advantages + values.float(), torch.zeros_like(advantages))


def _to_rows(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor):
    """Scatter the masked tokens of each sequence into row n of a padded [N, L] tensor.

    Returns the tensor and (token index, row, column) of every masked token.
    """
    token = torch.nonzero(mask).flatten()
    row = sequence_ids(cu_seqlens, mask.numel())[token]
    counts = torch.bincount(row, minlength=len(cu_seqlens) - 1)
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(token.numel(), device=mask.device) - starts[row]
    width = int(counts.max()) if token.numel() else 0
    rows = torch.zeros(len(cu_seqlens) - 1, width, dtype=values.dtype, device=values.device)
    rows[row, col] = values[token]
    return rows, (token, row, col)


def grpo_advantages(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group_size: int,
    *,
    mean_level: NormLevel = "group",
    std_level: NormLevel = "group",
    leave_one_out: bool = False,
    eps: float = 1e-5,
    kl_token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Token advantages [T] for GRPO.

    Each sequence's normalised reward is its advantage at every loss token. With
    ``kl_token_rewards`` (KL penalty in the reward, [T], e.g. ``-kl_ctl * kl``) the
    return-to-go of those per-token penalties is added, so a token is charged for
    the divergence of itself and what follows it.
    """
    seq_adv = normalize_rewards(rewards, group_size, mean_level, std_level, leave_one_out, eps, group)
    mask = loss_mask.bool()
    adv = torch.where(
        mask, broadcast_to_tokens(seq_adv, cu_seqlens, mask.numel()), torch.zeros_like(mask, dtype=torch.float32)
    )
    if kl_token_rewards is not None:
        kl_returns, _ = gae(kl_token_rewards.float(), None, mask, cu_seqlens, gamma=gamma, lam=1.0)
        adv = adv + kl_returns
    return adv


TEACHER_LOG_RATIO_BOUND = 20.0
"""The per-token reverse KL to the teacher is clamped to [-20, 20] nats (the bound of the KL's k3): a token the
teacher finds all but impossible (a logprob of -9999 where it reports -inf) would otherwise outweigh the batch."""


def teacher_advantages(
    policy_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    coef: float,
    gamma: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation's term of the advantages [T], and the per-token reverse KL [T] it comes from.

    ``reverse_kl_t = log pi(o_t) - log pi_teacher(o_t)`` (clamped to :data:`TEACHER_LOG_RATIO_BOUND`) on the loss
    tokens; the term is the return-to-go of ``-coef * reverse_kl`` with discount ``gamma`` (0: each token its
    own, as slime and Tinker). It is added after the estimator's normalisation, so the task reward keeps its
    scale beside it. Both are 0 outside ``loss_mask``.
    """
    mask = loss_mask.bool()
    reverse_kl = (policy_logp.float() - teacher_logp.float()).clamp(-TEACHER_LOG_RATIO_BOUND, TEACHER_LOG_RATIO_BOUND)
    reverse_kl = torch.where(mask, reverse_kl, torch.zeros_like(reverse_kl))
    if gamma == 0:
        return -coef * reverse_kl, reverse_kl
    term, _ = gae(-coef * reverse_kl, None, mask, cu_seqlens, gamma=gamma, lam=1.0)
    return term, reverse_kl


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group_size: int,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    mean_level: NormLevel = "batch",
    std_level: NormLevel = "batch",
    eps: float = 1e-5,
    kl_token_rewards: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token advantages [T] and returns [T] for PPO with a critic (``algorithm.adv_estimator: gae``).

    The token reward is the sequence's (shaped) outcome reward ``rewards`` [N] on its last loss
    token, plus ``kl_token_rewards`` [T] when the KL penalty is in the reward. :func:`gae` with the
    critic's ``values`` [T] gives the advantages and the returns the critic regresses on (before
    normalisation); the advantages are then normalised over the loss tokens of each group or of
    the batch (:func:`normalize_token_advantages`).
    """
    mask = loss_mask.bool()
    last = last_token_mask(mask, cu_seqlens)
    token_rewards = torch.where(last, broadcast_to_tokens(rewards.float(), cu_seqlens, mask.numel()), 0.0)
    if kl_token_rewards is not None:
        token_rewards = token_rewards + kl_token_rewards.float()
    advantages, returns = gae(token_rewards, values, mask, cu_seqlens, gamma=gamma, lam=lam)
    advantages = normalize_token_advantages(advantages, mask, cu_seqlens, group_size, mean_level, std_level, eps, group)
    return advantages, returns


def normalize_token_advantages(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group_size: int,
    mean_level: NormLevel = "batch",
    std_level: NormLevel = "batch",
    eps: float = 1e-5,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Whiten token advantages [T] over the loss tokens of each group (or the whole batch, over the
    data-parallel ``group``'s shares).

    The mean and the (population) std are taken over the loss tokens of the scope; ``none``
    skips that step. Tokens outside ``loss_mask`` stay 0.
    """
    mask = loss_mask.bool()
    n_seqs = len(cu_seqlens) - 1
    if n_seqs % group_size:
        raise ValueError(f"{n_seqs} sequences do not split into groups of group_size={group_size}")
    seq = sequence_ids(cu_seqlens, mask.numel())
    out = advantages.float()
    if mean_level != "none":
        mean, _ = _token_moments(out, mask, _token_scope(seq, group_size, mean_level), _batch(mean_level, group))
        out = out - mean
    if std_level != "none":
        scope = _token_scope(seq, group_size, std_level)
        _, var = _token_moments(advantages.float(), mask, scope, _batch(std_level, group))
        out = out / (var.sqrt() + eps)
    return torch.where(mask, out, torch.zeros_like(out))


def _token_scope(seq: torch.Tensor, group_size: int, level: NormLevel) -> torch.Tensor:
    """[T] index of the statistics' scope of each token: its group, or 0 for the batch."""
    if level == "group":
        return seq // group_size
    if level == "batch":
        return torch.zeros_like(seq)
    raise ValueError(f"unknown normalisation level {level!r}; expected 'group', 'batch' or 'none'")


def _batch(level: NormLevel, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    return group if level == "batch" else None


def _token_moments(
    values: torch.Tensor, mask: torch.Tensor, scope: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] mean and variance of the masked ``values`` of each token's scope (sums over ``group`` when given)."""
    zeros = torch.zeros(int(scope.max()) + 1 if scope.numel() else 1, device=values.device)
    weights = mask.float()
    count = batch_sum(zeros.index_add(0, scope, weights), group).clamp(min=1)
    mean = batch_sum(zeros.index_add(0, scope, values * weights), group) / count
    var = batch_sum(zeros.index_add(0, scope, (values - mean[scope]).square() * weights), group) / count
    return mean[scope], var[scope]


def grpo_estimate(rewards, values, loss_mask, cu_seqlens, cfg, kl_token_rewards=None, group=None):
    """``algorithm.adv_estimator: grpo`` with the actor's settings: (advantages [T], None)."""
    norm = cfg.adv_norm
    advantages = grpo_advantages(
        rewards,
        loss_mask,
        cu_seqlens,
        cfg.group_size,
        mean_level=norm.mean_level,
        std_level=norm.std_level,
        leave_one_out=norm.mean_leave1out,
        eps=norm.eps,
        kl_token_rewards=kl_token_rewards,
        gamma=cfg.discount,
        group=group,
    )
    return advantages, None


def gae_estimate(rewards, values, loss_mask, cu_seqlens, cfg, kl_token_rewards=None, group=None):
    """``algorithm.adv_estimator: gae`` with the actor's settings and a critic's ``values`` [T]:
    (advantages [T], returns [T])."""
    norm = cfg.adv_norm
    return gae_advantages(
        rewards,
        values,
        loss_mask,
        cu_seqlens,
        cfg.group_size,
        gamma=cfg.discount,
        lam=cfg.gae_lambda,
        mean_level=norm.mean_level,
        std_level=norm.std_level,
        eps=norm.eps,
        kl_token_rewards=kl_token_rewards,
        group=group,
    )


ADVANTAGE_ESTIMATORS = {"grpo": grpo_estimate, "gae": gae_estimate}
"""``actor.adv_estimator`` -> ``fn(rewards [N], values [T] | None, loss_mask [T], cu_seqlens, actor config,
kl_token_rewards [T] | None, group) -> (advantages [T], returns [T] | None)``: it returns what it computes;
``group``, the data-parallel group, is where batch-level statistics are summed."""
