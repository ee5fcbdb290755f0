"""The trajectory tensor-dict format exchanged between rollout and training.

One trajectory is a dict of tensors with a leading batch dimension::

    input_ids       [n, seq_len] int32   prompt + completion token ids
    attention_mask  [n, seq_len] bool    True on real tokens, False on padding
    loss_mask       [n, seq_len] int32   1 on generated tokens (trained on), else 0
    logprobs        [n, seq_len] float32 behaviour log-probability of generated tokens, 0 elsewhere
    versions        [n, seq_len] int32   weight version that generated each token, -1 elsewhere
    rewards         [n]          float32 one reward per sequence

Prompt positions carry loss_mask 0, logprobs 0 and versions -1. Sequences are right
padded. :func:`concat_padded_tensors` joins several such dicts along the batch dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megarl.utils.host_tensors import host_list, host_tensor

TOKEN_ID_DTYPE = torch.int32
"""The dtype of a trajectory's token ids: no vocabulary megarl trains holds an id beyond it."""
TOKEN_ID_LIMIT = torch.iinfo(TOKEN_ID_DTYPE).max + 1
"""Every token id is below this."""

# Value put in padded positions; keys not listed here pad with 0.
PAD_VALUES = {"versions": -1}
SEQUENCE_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")


def _seq_len(traj: dict[str, Any]) -> int:
    mask = traj.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError("a trajectory needs a 2-D 'attention_mask' tensor [n, seq_len]")
    return mask.shape[1]


def _pad_to(key: str, value: torch.Tensor, seq_len: int, length: int) -> torch.Tensor:
    """Right-pad ``value`` when its second dim is the sequence dim; leave others alone."""
    if value.dim() < 2 or value.shape[1] != seq_len or seq_len == length:
        return value
    pad_shape = (value.shape[0], length - seq_len, *value.shape[2:])
    pad = torch.full(pad_shape, PAD_VALUES.get(key, 0), dtype=value.dtype, device=value.device)
    return torch.cat([value, pad], dim=1)


def concat_padded_tensors(trajs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate trajectory dicts along dim 0, right-padding sequence tensors.

    Every dict must have the same keys. Tensors whose dim 1 equals the dict's
    ``attention_mask`` length are sequence tensors and get padded (``versions`` with
    -1, everything else with 0); others (``rewards``) are concatenated as they are.
    Non-tensor values become lists.
    """
    trajs = list(trajs)
    if not trajs:
        return {}
    keys = set(trajs[0])
    for i, traj in enumerate(trajs):
        if set(traj) != keys:
            raise ValueError(
                f"concat_padded_tensors: trajectory {i} has keys {sorted(traj)}, trajectory 0 has {sorted(keys)}"
            )
    seq_lens = [_seq_len(t) for t in trajs]
    length = max(seq_lens)
    out: dict[str, Any] = {}
    for key in trajs[0]:
        values = [t[key] for t in trajs]
        if all(isinstance(v, torch.Tensor) for v in values):
            out[key] = torch.cat([_pad_to(key, v, n, length) for v, n in zip(values, seq_lens)], dim=0)
        else:
            out[key] = [item for v in values for item in (v if isinstance(v, list) else [v])]
    return out


def make_trajectory(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    output_logprobs: Sequence[float],
    output_versions: Sequence[int],
    reward: float,
    output_routed_experts: Sequence[Sequence[int]] | None = None,
    input_routed_experts: Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """A one-row trajectory ``[1, len(prompt) + len(output)]`` from one generation.

    ``output_routed_experts`` (MoE, :mod:`megarl.actor.moe_routing`): per output token, the experts of the
    server's forward that produced it; ``input_routed_experts`` the same for the prompt's tokens after
    the first. Kept as ``routed_experts`` ``[1, n, layers * top-k]``, -1 where there are none.
    """
    n_in, n_out = len(prompt_ids), len(output_ids)
    if len(output_logprobs) != n_out or len(output_versions) != n_out:
        raise ValueError(
            f"make_trajectory: {n_out} output tokens but {len(output_logprobs)} logprobs "
            f"and {len(output_versions)} versions"
        )
    traj = build_trajectory(
        list(prompt_ids) + list(output_ids),
        [0] * n_in + [1] * n_out,
        [0.0] * n_in + list(output_logprobs),
        [-1] * n_in + list(output_versions),
        reward,
    )
    if output_routed_experts is not None and n_out:
        if len(output_routed_experts) != n_out:
            raise ValueError(
                f"make_trajectory: {n_out} output tokens but routed experts for {len(output_routed_experts)}"
            )
        routed = torch.tensor(output_routed_experts, dtype=torch.int16)  # [n_out, layers * top-k]
        prompt = torch.full((n_in, routed.shape[1]), -1, dtype=torch.int16)
        if input_routed_experts is not None:
            if len(input_routed_experts) != n_in - 1:
                raise ValueError(
                    f"make_trajectory: {n_in} prompt tokens but input routed experts for {len(input_routed_experts)} "
                    f"(one per prompt token after the first: {n_in - 1})"
                )
            if n_in > 1:
                prompt[1:] = torch.tensor(input_routed_experts, dtype=torch.int16).view(n_in - 1, -1)
        traj["routed_experts"] = torch.cat([prompt, routed])[None]
    return traj


def response_trajectory(resp, reward: float) -> dict[str, torch.Tensor]:
    """:func:`make_trajectory` of one :class:`~megarl.api.io_struct.ModelResponse` (its tokens, logprobs,
    versions and, with ``rollout.return_routed_experts``, its routed experts)."""
    return make_trajectory(
        resp.input_tokens,
        resp.output_tokens,
        resp.output_logprobs,
        resp.output_versions,
        reward,
        resp.output_routed_experts,
        resp.input_routed_experts,
    )


def build_trajectory(
    input_ids: Sequence[int],
    loss_mask: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
    reward: float,
) -> dict[str, torch.Tensor]:
    """A one-row trajectory from aligned per-token lists (multi-turn episodes)."""
    n = len(input_ids)
    if not (len(loss_mask) == len(logprobs) == len(versions) == n):
        raise ValueError(
            f"build_trajectory: lengths differ: input_ids {n}, loss_mask {len(loss_mask)}, "
            f"logprobs {len(logprobs)}, versions {len(versions)}"
        )
    # built on the rollout pool's thread: numpy, not torch operations (megarl.utils.host_tensors)
    return {
        "input_ids": host_tensor([list(input_ids)], TOKEN_ID_DTYPE),
        "attention_mask": host_tensor([[True] * n], torch.bool),
        "loss_mask": host_tensor([list(loss_mask)], torch.int32),
        "logprobs": host_tensor([list(logprobs)], torch.float32),
        "versions": host_tensor([list(versions)], torch.int32),
        "rewards": host_tensor([float(reward)], torch.float32),
    }


def oldest_version(traj: dict[str, Any]) -> int | None:
    """The oldest weight version of any generated token in ``traj`` (None if it has none)."""
    versions = traj.get("versions")
    if not isinstance(versions, torch.Tensor):
        return None
    return min((v for v in set(host_list(versions)) if v >= 0), default=None)  # a few distinct versions


def batch_size_of(traj: dict[str, Any]) -> int:
    """Rows (trajectories) in a tensor dict."""
    return int(traj["attention_mask"].shape[0])
