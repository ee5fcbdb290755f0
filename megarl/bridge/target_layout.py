"""The target layout: which slice of which HF tensor each inference worker holds.

An inference server of tensor-parallel size ``R`` holds, on worker ``r``, the HF tensors
sliced the way vLLM's parallel layers slice them (SGLang's layers are the same design).
Verified against vLLM 0.32 (``model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``, ``fused_moe/layer.py``):

* ``QKVParallelLinear`` (``qkv_proj``): ``[q heads of r; k heads of r; v heads of r]``.
  Query heads split evenly; KV heads split evenly, or, when ``R`` exceeds the KV heads,
  each KV head is replicated on ``R / num_kv_heads`` consecutive ranks (rank ``r`` holds
  KV head ``r // replicas``).
* ``MergedColumnParallelLinear`` (``gate_up_proj``): ``[gate chunk r; up chunk r]``.
* ``ColumnParallelLinear`` / ``RowParallelLinear``: chunk ``r`` of dim 0 / dim 1.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple
  of 64, then ``padded / R`` rows per rank; rows past the real vocabulary are padding.
* ``FusedMoE`` (no expert parallelism): every expert on every rank,
  ``w13_weight[e] = [gate chunk r; up chunk r]`` and ``w2_weight[e]`` = chunk ``r`` of dim 1.
* Norms, the MoE router and QK norms: replicated.

Which kind of slice a tensor gets is read from the family mapping's split kind
(``megarl.models.mapping``): the HF tensors Megatron splits by columns are the ones vLLM
splits by columns, and so on; only the fused layouts and the names differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models.mapping import ParamRule

VLLM_VOCAB_PADDING = 64  # vllm DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of HF tensor ``hf`` along the split dim (``hf`` None: padding rows)."""

    hf: str | None
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class LocalTensor:
    """One tensor (or one expert's slice of a fused-expert tensor) that a worker holds."""

    name: str
    """Receiver-side parameter name (vLLM's naming, e.g. ``...self_attn.qkv_proj.weight``)."""
    expert: int | None
    """Index into the expert dim of a fused-expert parameter; None for plain parameters."""
    shape: tuple[int, ...]
    """Local shape (of the expert's slice for experts)."""
    dim: int | None
    """Dim the segments run along; None when the worker holds the whole HF tensor."""
    segments: tuple[Segment, ...]
    """What the local tensor is made of along ``dim``, in order."""


def _chunk(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if n % size:
        raise ValueError(f"{what}: {n} does not split over inference tensor-parallel size {size}")
    step = n // size
    return rank * step, (rank + 1) * step


def _rename(name: str, old: str, new: str) -> str:
    head, sep, tail = name.rpartition(f".{old}.")
    if not sep:
        raise ValueError(f"cannot map HF tensor {name!r} to vLLM's fused name (no '.{old}.')")
    return f"{head}.{new}.{tail}"


def _expert_param(name: str, kind: str) -> tuple[str, int]:
    """``...experts.{e}.gate_proj.weight`` -> (``...experts.w13_weight``, e)."""
    head, sep, tail = name.partition(".experts.")
    if not sep:
        raise ValueError(f"expert tensor {name!r} has no '.experts.' component")
    return f"{head}.experts.{kind}_weight", int(tail.split(".", 1)[0])


class VLLMLayout:
    """vLLM's tensor-parallel layout of an HF model (``R`` workers, no expert parallelism)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        tp: int,
        vocab_padding: int = VLLM_VOCAB_PADDING,
    ):
        if tp < 1 or num_heads % tp:
            raise ValueError(f"inference tensor-parallel size {tp} must divide the {num_heads} attention heads")
        if not (num_kv_heads % tp == 0 or tp % num_kv_heads == 0):
            raise ValueError(
                f"inference tensor-parallel size {tp} and {num_kv_heads} KV heads: one must divide the other"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.vocab_size, self.tp, self.vocab_padding = vocab_size, tp, vocab_padding

    def local_tensors(
        self, rule: ParamRule, hf_names: tuple[str, ...], shapes: dict[str, tuple[int, ...]], rank: int
    ) -> list[LocalTensor]:
        """What worker ``rank`` holds of the HF tensors ``hf_names`` of one mapping row."""
        split, first = rule.split, hf_names[0]
        shape = shapes[first]
        if split == "replicated":
            return [LocalTensor(first, None, shape, None, (Segment(first, 0, shape[0] if shape else 1),))]
        if split == "qkv":
            return [self._qkv(hf_names, shapes, rank)]
        if split == "gate_up":
            return [self._gate_up(rule, hf_names, shapes, rank)]
        if split == "vocab":
            return [self._vocab(first, shape, rank)]
        dim = 0 if split == "column" else 1
        start, stop = _chunk(shape[dim], rank, self.tp, first)
        name, expert = first, None
        if rule.is_expert:
            name, expert = _expert_param(first, "w2" if split == "row" else "w13")
        local = list(shape)
        local[dim] = stop - start
        return [LocalTensor(name, expert, tuple(local), dim, (Segment(first, start, stop),))]

    def _qkv(self, names, shapes, rank: int) -> LocalTensor:
        hd = self.head_dim
        q0, q1 = _chunk(self.num_heads, rank, self.tp, "query heads")
        if self.tp >= self.num_kv_heads:
            kv = rank // (self.tp // self.num_kv_heads)
            k0, k1 = kv, kv + 1
        else:
            k0, k1 = _chunk(self.num_kv_heads, rank, self.tp, "KV heads")
        segments = (
            Segment(names[0], q0 * hd, q1 * hd),
            Segment(names[1], k0 * hd, k1 * hd),
            Segment(names[2], k0 * hd, k1 * hd),
        )
        rows = sum(s.length for s in segments)
        return LocalTensor(_rename(names[0], "q_proj", "qkv_proj"), None, (rows, *shapes[names[0]][1:]), 0, segments)

    def _gate_up(self, rule: ParamRule, names, shapes, rank: int) -> LocalTensor:
        shape = shapes[names[0]]
        start, stop = _chunk(shape[0], rank, self.tp, names[0])
        segments = (Segment(names[0], start, stop), Segment(names[1], start, stop))
        local = (2 * (stop - start), *shape[1:])
        if rule.is_expert:
            name, expert = _expert_param(names[0], "w13")
            return LocalTensor(name, expert, local, 0, segments)
        return LocalTensor(_rename(names[0], "gate_proj", "gate_up_proj"), None, local, 0, segments)

    def _vocab(self, name: str, shape: tuple[int, ...], rank: int) -> LocalTensor:
        if shape[0] != self.vocab_size:
            raise ValueError(f"{name}: {shape[0]} rows, but the vocabulary has {self.vocab_size}")
        padded = -(-self.vocab_size // self.vocab_padding) * self.vocab_padding
        start, stop = _chunk(padded, rank, self.tp, "padded vocabulary")
        real_stop = min(stop, self.vocab_size)
        segments = []
        if start < real_stop:
            segments.append(Segment(name, start, real_stop))
        if stop > max(start, real_stop):
            segments.append(Segment(None, 0, stop - max(start, real_stop)))
        return LocalTensor(name, None, (stop - start, *shape[1:]), 0, tuple(segments))
