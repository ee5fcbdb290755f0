"""The train–inference gap on the tokens trained in each step.

For every loss token the update trains on, ``|trainer logprob - server logprob|``: the trainer's
from the recompute pass (``prox_logp``) or from the update's own forward on the weights before
the update; the server's is the behaviour logprob the rollout returned. Recorded per step
(``ppo_actor/gap/...`` in the step metrics):

* ``abs_logp_diff/{avg,min,max,p99}`` over every trained token of every rank (p99: nearest rank,
  exact, gathered over the data-parallel group);
* ``lag_{k}/abs_logp_diff/{avg,min,max}``: split by version lag (trainer version minus the
  version that generated the token). Lag 0 is the same weights on both sides, so its gap is
  numerics alone (dtype, kernels, batching); lag >= 1 adds the policy's own change;
* ``server_{i}/abs_logp_diff/{avg,min,max}``: split by the server that generated the episode
  (``i`` indexes ``rollout.server_addrs``; -1: the episode used several servers).

The share of tokens whose behaviour weight the cap drops is ``ppo_actor/capped_ratio``.
:func:`gap_warning` turns a lag-0 mean above a threshold into a console line.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megarl.utils import stats_tracker

LAG_0_KEY = "ppo_actor/gap/lag_0/abs_logp_diff/avg"


class GapMeter:
    """Collects the gap of one optimizer step's micro-batches; :meth:`finish` adds the p99."""

    def __init__(self) -> None:
        self._values: list[torch.Tensor] = []

    def record(self, mb: dict, trainer_logp: torch.Tensor, mask: torch.Tensor) -> None:
        """The gap of one packed micro-batch's loss tokens (``mask``); needs ``behaviour_logp`` in ``mb``."""
        gap = (trainer_logp.detach().float() - mb["behaviour_logp"].float()).abs()
        _record(gap, mask, "gap")
        # one host sync per micro-batch for the split keys: lags and servers are a handful of values
        for name, index in (("lag", mb.get("version_lag")), ("server", mb.get("token_server"))):
            if index is None:
                continue
            for value in index[mask].unique().tolist():
                _record(gap, mask & (index == value), f"gap/{name}_{value}")
        self._values.append(gap[mask])

    def finish(self, dp_group: dist.ProcessGroup | None) -> None:
        """Record the p99 over the step's tokens on every data-parallel rank (collective over ``dp_group``)."""
        local = torch.cat(self._values) if self._values else torch.empty(0)
        if not self._values:  # a step that trained nothing still reports its count: 0
            stats_tracker.denominator(**{"gap/n_tokens": torch.zeros(1, dtype=torch.bool)})
        self._values = []
        values = _all_gather_varlen(local.double().cpu(), dp_group)
        if values.numel():
            rank = max(1, math.ceil(0.99 * values.numel()))  # nearest-rank percentile
            stats_tracker.scalar(**{"gap/abs_logp_diff/p99": float(values.kthvalue(rank).values)})


def _record(gap: torch.Tensor, mask: torch.Tensor, prefix: str) -> None:
    stats_tracker.denominator(**{f"{prefix}/n_tokens": mask})
    stats_tracker.stat(denominator=f"{prefix}/n_tokens", **{f"{prefix}/abs_logp_diff": gap})


def _all_gather_varlen(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's 1-D ``local`` (of any length), concatenated in rank order."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([local.numel()]), group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=local.dtype)
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[: int(size.item())] for part, size in zip(parts, sizes)])


def version_lag(data: dict, loss_mask: torch.Tensor, version: int) -> torch.Tensor:
    """``version`` minus each next-token-aligned loss token's generating version; -1 off the loss tokens."""
    if "versions" not in data:
        return torch.where(loss_mask, 0, -1)
    generated = torch.roll(data["versions"].long(), shifts=-1, dims=-1)
    return torch.where(loss_mask & (generated >= 0), version - generated, -1)


def gap_warning(stats: dict[str, float], threshold: float) -> str | None:
    """A console line when the lag-0 tokens' mean gap passes ``threshold``, else None."""
    mean = stats.get(LAG_0_KEY)
    if mean is None or mean <= threshold:
        return None
    n = int(stats.get("ppo_actor/gap/lag_0/n_tokens", 0))
    p99 = stats.get("ppo_actor/gap/abs_logp_diff/p99", float("nan"))
    return (
        f"train-inference gap: the {n} tokens trained at version lag 0 differ from the servers' logprobs by "
        f"{mean:.4g} on average (> weight_update.gap_threshold={threshold:g}; p99 over all tokens {p99:.4g}): "
        "the servers do not compute what the trainer does (weights, dtype or sampling settings differ), "
        "and the policy ratios are off by as much"
    )
