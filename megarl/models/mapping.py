"""The HF <-> Megatron weight mapping as data, and the tensor rules that apply it.

A family (``megarl.models.families``) is a table of :class:`ParamRule` rows. Each row
says, for one Megatron parameter (named in *canonical* form: global layer index,
global expert index, local-spec module names):

* which HF tensor(s) it comes from — one, or several merged into one Megatron
  tensor (``q, k, v`` → ``linear_qkv``; ``gate, up`` → ``linear_fc1``);
* how the Megatron tensor is split over tensor-parallel ranks (:data:`Split`):

  ===========  =================================================================
  replicated   every rank holds the whole tensor (norms, router)
  column       dim 0 in equal contiguous chunks (plain column-parallel linear)
  row          dim 1 in equal contiguous chunks (row-parallel linear)
  vocab        dim 0, after padding the vocabulary to a multiple of TP
  qkv          dim 0 by KV groups; inside a group: its query heads, then k, then v
  gate_up      dim 0; each rank holds [its gate chunk; its up chunk]
  ===========  =================================================================

* expert rows (``{expert}`` in the template) split over the expert-tensor-parallel
  group instead of the tensor-parallel group, and experts themselves are spread
  over expert-parallel ranks (global expert ``e`` lives on EP rank
  ``e // experts_per_rank`` as local expert ``e % experts_per_rank``).

The functions below are pure (no process groups): :func:`load_shard` builds one
rank's shard from a reader of HF slices (reading only what the shard needs) and
:func:`export_from_shards` turns the shards of all TP ranks back into HF tensors.
HF loading, HF export and the weight bridge all go through these two.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch

Split = Literal["replicated", "column", "row", "vocab", "qkv", "gate_up"]
SPLITS = ("replicated", "column", "row", "vocab", "qkv", "gate_up")

# read(hf_name, dim, start, stop) -> the HF tensor sliced to [start, stop) along dim
# (dim None: the whole tensor).
Reader = Callable[[str, "int | None", int, int], torch.Tensor]


@dataclass(frozen=True)
class ModelDims:
    """The sizes the split rules need."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    """The HF vocabulary (rows of the embedding on disk)."""
    padded_vocab_size: int
    """Rows of Megatron's embedding / output layer (``vocab_size`` padded to a TP multiple)."""

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


@dataclass(frozen=True)
class ParamRule:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str
    """Canonical Megatron name template, e.g. ``decoder.layers.{layer}.mlp.linear_fc2.weight``."""
    hf: tuple[str, ...]
    """HF name template(s); several when merged (qkv: q, k, v; gate_up: gate, up)."""
    split: Split
    """How the Megatron tensor is split over (expert) tensor-parallel ranks."""
    export: bool = True
    """False for a Megatron copy of a tensor exported elsewhere (tied output layer)."""
    optional: bool = False
    """The HF checkpoint may lack it (a critic's value head in a causal-LM checkpoint): loading then
    keeps the parameter's initial value."""

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"ParamRule {self.megatron!r}: split {self.split!r} not in {SPLITS}")
        want = {"qkv": 3, "gate_up": 2}.get(self.split, 1)
        if len(self.hf) != want:
            raise ValueError(f"ParamRule {self.megatron!r}: split {self.split!r} takes {want} HF names, got {self.hf}")

    @property
    def is_expert(self) -> bool:
        return "{expert}" in self.megatron

    def hf_names(self, **fields: int) -> tuple[str, ...]:
        return tuple(name.format(**fields) for name in self.hf)


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{layer\}|\{expert\})", template)
    out = []
    for part in parts:
        if part in ("{layer}", "{expert}"):
            out.append(rf"(?P<{part[1:-1]}>\d+)")
        else:
            out.append(re.escape(part))
    return re.compile("^" + "".join(out) + "$")


class FamilyMapping:
    """A family's rules, looked up by canonical Megatron name."""

    def __init__(self, rules: tuple[ParamRule, ...]):
        self.rules = rules
        self._patterns = [(_template_regex(rule.megatron), rule) for rule in rules]

    def hf_names_not_loaded(self, hf_names: Iterable[str], tied: bool) -> list[str]:
        """The names among ``hf_names`` (an HF checkpoint's tensors) that no rule loads, sorted: a feature
        the family's layers lack. RoPE's cached inverse frequencies and, when ``tied``, a checkpoint's own
        ``lm_head.weight`` (HF ignores it then too) are not reported."""
        patterns = [_template_regex(name) for rule in self.rules for name in rule.hf]
        return sorted(
            name
            for name in hf_names
            if not name.endswith("rotary_emb.inv_freq")
            and not (tied and name == "lm_head.weight")
            and not any(p.match(name) for p in patterns)
        )

    def match(self, megatron_name: str) -> tuple[ParamRule, dict[str, int]]:
        """The rule for ``megatron_name`` and its ``layer`` / ``expert`` fields."""
        for pattern, rule in self._patterns:
            found = pattern.match(megatron_name)
            if found:
                return rule, {k: int(v) for k, v in found.groupdict().items()}
        raise KeyError(f"no HF mapping for Megatron parameter {megatron_name!r}")


# ---------------------------------------------------------------------------------------
# HF -> one rank's shard
# ---------------------------------------------------------------------------------------


def _chunk(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if n % size:
        raise ValueError(f"{what}: {n} does not split over {size} tensor-parallel ranks")
    step = n // size
    return rank * step, (rank + 1) * step


def load_shard(
    rule: ParamRule, names: tuple[str, ...], read: Reader, shape: tuple[int, ...], rank: int, size: int, dims: ModelDims
) -> torch.Tensor:
    """The shard of TP rank ``rank`` of ``size``; ``shape`` is the full HF shape of ``names[0]``."""
    split = rule.split
    if split == "replicated" or size == 1 and split not in ("qkv", "gate_up", "vocab"):
        return read(names[0], None, 0, 0)
    if split == "column":
        return read(names[0], 0, *_chunk(shape[0], rank, size, rule.megatron))
    if split == "row":
        return read(names[0], 1, *_chunk(shape[1], rank, size, rule.megatron))
    if split == "vocab":
        return _vocab_shard(names[0], read, shape, rank, size, dims)
    if split == "gate_up":
        bounds = _chunk(shape[0], rank, size, rule.megatron)
        return torch.cat([read(name, 0, *bounds) for name in names], dim=0)
    return _qkv_shard(names, read, rank, size, dims, rule.megatron)


def _vocab_shard(name, read, shape, rank, size, dims: ModelDims) -> torch.Tensor:
    start, stop = _chunk(dims.padded_vocab_size, rank, size, "padded vocabulary")
    real = read(name, 0, start, min(stop, shape[0])) if start < shape[0] else None
    pad_rows = stop - max(start, shape[0])
    if pad_rows <= 0:
        return real
    pad = torch.zeros((pad_rows, *shape[1:]), dtype=real.dtype if real is not None else torch.float32)
    return pad if real is None else torch.cat([real, pad], dim=0)


def _qkv_shard(names, read, rank, size, dims: ModelDims, what: str) -> torch.Tensor:
    """Local groups of the fused QKV: per group [its q heads; k; v] stacked along dim 0."""
    g0, g1 = _chunk(dims.num_query_groups, rank, size, f"{what} (KV groups)")
    hd, qpg = dims.head_dim, dims.heads_per_group
    q = read(names[0], 0, g0 * qpg * hd, g1 * qpg * hd)
    k = read(names[1], 0, g0 * hd, g1 * hd)
    v = read(names[2], 0, g0 * hd, g1 * hd)
    groups = g1 - g0
    q = q.reshape(groups, qpg * hd, *q.shape[1:])
    k = k.reshape(groups, hd, *k.shape[1:])
    v = v.reshape(groups, hd, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


# ---------------------------------------------------------------------------------------
# all TP ranks' shards -> HF tensors
# ---------------------------------------------------------------------------------------


def export_from_shards(
    rule: ParamRule, names: tuple[str, ...], shards: list[torch.Tensor], dims: ModelDims
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`load_shard`: the HF tensors from the shards of ranks ``0..len-1``."""
    split = rule.split
    if split == "replicated":
        return {names[0]: shards[0]}
    if split == "row":
        return {names[0]: torch.cat(shards, dim=1)}
    if split == "column":
        return {names[0]: torch.cat(shards, dim=0)}
    if split == "vocab":
        return {names[0]: torch.cat(shards, dim=0)[: dims.vocab_size]}
    if split == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return {names[0]: torch.cat([h[0] for h in halves]), names[1]: torch.cat([h[1] for h in halves])}
    return _qkv_export(names, torch.cat(shards, dim=0), dims)


def _qkv_export(names, fused: torch.Tensor, dims: ModelDims) -> dict[str, torch.Tensor]:
    hd, qpg, ng = dims.head_dim, dims.heads_per_group, dims.num_query_groups
    grouped = fused.reshape(ng, (qpg + 2) * hd, *fused.shape[1:])
    q, k, v = grouped.split([qpg * hd, hd, hd], dim=1)
    flat = lambda t: t.reshape(-1, *fused.shape[1:]).contiguous()
    return {names[0]: flat(q), names[1]: flat(k), names[2]: flat(v)}


def expert_placement(global_expert: int, num_experts: int, ep_size: int) -> tuple[int, int]:
    """(EP rank, local index) of ``global_expert`` under Megatron's contiguous expert split."""
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over expert parallel size {ep_size}")
    per_rank = num_experts // ep_size
    return global_expert // per_rank, global_expert % per_rank
