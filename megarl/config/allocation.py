"""The parallel-strategy grammar: ``allocation_mode`` strings.

An allocation mode says which devices run inference servers and which run the
Megatron trainer, and how each is parallelised::

    vllm:d4t2+megatron:d2p2t2e2
    └──┬───┘ └────────┬───────┘
    inference        training
    4 servers of     DP 2 x PP 2 x TP 2 = 8 ranks, experts split 2 ways (EP 2)
    TP 2 = 8 devices

Inference part: ``vllm:`` or ``sglang:`` then ``d`` (replicas), ``t`` (tensor
parallel), optional ``p`` (pipeline parallel inside a server).
Training part: ``megatron:`` then ``d`` (data), ``p`` (pipeline), ``t`` (tensor) and
optionally ``e`` (expert), ``et`` (expert tensor), ``v`` (virtual pipeline stages
per rank), ``c`` (context). Omitted sizes are 1, except ``et`` which defaults to
``t`` as in Megatron-Core. ``+`` joins disaggregated parts (separate devices).
``|`` joins colocated parts: servers and trainer share the same devices and take
turns (``vllm:d2t1|megatron:d2p1t1``: two servers and two trainer ranks on two
devices; both parts must use the same number of devices). Either part may stand
alone (inference-only evaluation, or training without rollout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

INFERENCE_BACKENDS = ("vllm", "sglang")
TRAINING_BACKENDS = ("megatron",)

_INFERENCE_DIMS = ("d", "t", "p")
_TRAINING_DIMS = ("d", "p", "t", "e", "et", "v", "c")
_DIM_RE = re.compile(r"(et|[a-z])(\d+)")
_DIM_NAMES = {
    "d": "data parallel",
    "t": "tensor parallel",
    "p": "pipeline parallel",
    "e": "expert parallel",
    "et": "expert tensor parallel",
    "v": "virtual pipeline",
    "c": "context parallel",
}


class AllocationError(ValueError):
    """An allocation mode that cannot be parsed or does not fit the cluster or model."""


@dataclass(frozen=True)
class InferenceAllocation:
    """Inference servers: ``dp`` independent replicas, each sharded ``tp`` x ``pp`` ways."""

    backend: Literal["vllm", "sglang"]
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def devices_per_server(self) -> int:
        return self.tp * self.pp

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        pp = f"p{self.pp}" if self.pp > 1 else ""
        return f"{self.backend}:d{self.dp}{pp}t{self.tp}"


@dataclass(frozen=True)
class TrainingAllocation:
    """The Megatron trainer's layout.

    ``world_size = dp * pp * tp * cp``. Expert layers re-split the same ranks:
    per pipeline stage, ``dp * tp * cp`` ranks form ``ep * etp`` expert shards times
    an expert-data-parallel remainder (``edp``).
    """

    backend: Literal["megatron"] = "megatron"
    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    cp: int = 1

    @property
    def expert_tp(self) -> int:
        """Expert tensor parallel size; Megatron-Core defaults it to ``tp``."""
        return self.tp if self.etp is None else self.etp

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def edp(self) -> int:
        """Expert data parallel size (ranks holding identical expert shards)."""
        return self.dp * self.tp * self.cp // (self.ep * self.expert_tp)

    # AReaL's ParallelStrategy names (``allocation_mode.train.dp_size`` in its tutorials)
    dp_size = property(lambda self: self.dp, doc="``dp``, by AReaL's name.")
    tp_size = property(lambda self: self.tp, doc="``tp``, by AReaL's name.")
    pp_size = property(lambda self: self.pp, doc="``pp``, by AReaL's name.")
    cp_size = property(lambda self: self.cp, doc="``cp``, by AReaL's name.")
    ep_size = property(lambda self: self.ep, doc="``ep``, by AReaL's name.")

    @property
    def dense_replicas(self) -> int:
        """Ranks holding identical copies of each dense (non-expert) shard: ``dp * cp``."""
        return self.dp * self.cp

    def place_layer(self, layer: int, num_layers: int) -> tuple[int, int]:
        """(pipeline stage, virtual chunk) of a global layer under Megatron's even split."""
        if num_layers % (self.pp * self.vpp):
            raise ValueError(f"{num_layers} layers do not split evenly over pp {self.pp} x vpp {self.vpp}")
        per_chunk = num_layers // self.vpp  # layers of one virtual chunk over all stages
        chunk, within = divmod(layer, per_chunk)
        return within // (per_chunk // self.pp), chunk

    def __str__(self) -> str:
        dims = f"d{self.dp}p{self.pp}t{self.tp}"
        for key, value, default in (("e", self.ep, 1), ("et", self.etp, None), ("v", self.vpp, 1), ("c", self.cp, 1)):
            if value != default:
                dims += f"{key}{value}"
        return f"{self.backend}:{dims}"


@dataclass(frozen=True)
class AllocationMode:
    """A parsed ``allocation_mode``: optional inference part, optional training part."""

    inference: InferenceAllocation | None = None
    train: TrainingAllocation | None = None
    colocated: bool = False
    """Inference and training share their devices (``|``) and take turns on them."""

    @classmethod
    def from_str(cls, spec: str) -> AllocationMode:
        """Parse ``spec``; raise :class:`AllocationError` naming the offending part."""
        return parse_allocation_mode(spec)

    @property
    def world_size(self) -> int:
        """Devices needed in all: the parts' sum, or one part's when they are colocated."""
        if self.colocated:
            return self.train.world_size
        inference = self.inference.world_size if self.inference else 0
        return inference + (self.train.world_size if self.train else 0)

    def __str__(self) -> str:
        return ("|" if self.colocated else "+").join(str(p) for p in (self.inference, self.train) if p is not None)


@dataclass(frozen=True)
class ModelShape:
    """The few model sizes that constrain a parallel layout (read from an HF config)."""

    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    num_experts: int = 0
    vocab_size: int = 0
    """0: unknown."""

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        """Build from a ``transformers`` config object or its ``config.json`` dict."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts") or 0
        return cls(
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            num_hidden_layers=get("num_hidden_layers"),
            num_experts=experts,
            vocab_size=get("vocab_size") or 0,
        )


def parse_allocation_mode(spec: str) -> AllocationMode:
    """Parse an allocation-mode string such as ``vllm:d4t2+megatron:d2p2t2e2``."""
    if not isinstance(spec, str) or not spec.strip():
        raise AllocationError(f"allocation_mode is empty ({spec!r}); expected e.g. 'vllm:d1t1+megatron:d1p1t1'")
    spec = spec.strip()
    if "|" in spec and "+" in spec:
        raise AllocationError(f"allocation_mode {spec!r}: use either '+' (separate devices) or '|' (shared), not both")
    if "|" in spec:
        return _colocated(_parse_parts(spec.split("|"), spec), spec)
    return _parse_parts(spec.split("+"), spec)


def _colocated(alloc: AllocationMode, spec: str) -> AllocationMode:
    if alloc.inference.world_size != alloc.train.world_size:
        raise AllocationError(
            f"allocation_mode {spec!r}: colocated parts share their devices, so both must use the same number: "
            f"inference '{alloc.inference}' uses {alloc.inference.world_size}, training '{alloc.train}' "
            f"uses {alloc.train.world_size}"
        )
    return replace(alloc, colocated=True)


def _parse_parts(parts: list[str], spec: str) -> AllocationMode:
    inference = train = None
    for part in parts:
        part = part.strip()
        backend, _, dims = part.partition(":")
        if backend in INFERENCE_BACKENDS:
            if inference is not None:
                raise AllocationError(f"allocation_mode {spec!r}: more than one inference part ({part!r})")
            inference = InferenceAllocation(backend, **_parse_dims(dims, _INFERENCE_DIMS, part, spec))
        elif backend in TRAINING_BACKENDS:
            if train is not None:
                raise AllocationError(f"allocation_mode {spec!r}: more than one training part ({part!r})")
            train = _training(_parse_dims(dims, _TRAINING_DIMS, part, spec), part, spec)
        else:
            known = ", ".join(f"'{b}:'" for b in INFERENCE_BACKENDS + TRAINING_BACKENDS)
            raise AllocationError(
                f"allocation_mode {spec!r}: part {part!r} has unknown backend {backend!r}; expected one of {known}"
            )
    return AllocationMode(inference=inference, train=train)


def _parse_dims(dims: str, allowed: tuple[str, ...], part: str, spec: str) -> dict[str, int]:
    where = f"allocation_mode {spec!r}, part {part!r}"
    if not dims:
        raise AllocationError(f"{where}: no sizes after ':' (expected e.g. 'd2t1')")
    matches = list(_DIM_RE.finditer(dims))
    if "".join(m.group(0) for m in matches) != dims:
        raise AllocationError(f"{where}: cannot read {dims!r}; sizes are letters followed by numbers, e.g. 'd2p2t2'")
    sizes: dict[str, int] = {}
    for match in matches:
        key, value = match.group(1), int(match.group(2))
        if key not in allowed:
            raise AllocationError(f"{where}: unknown size {key!r}{value}; allowed here: {', '.join(allowed)}")
        if key in sizes:
            raise AllocationError(f"{where}: size {key!r} given twice")
        if value < 1:
            raise AllocationError(f"{where}: {_DIM_NAMES[key]} size {key}{value} must be >= 1")
        sizes[key] = value
    field_names = {"d": "dp", "t": "tp", "p": "pp", "e": "ep", "et": "etp", "v": "vpp", "c": "cp"}
    return {field_names[k]: v for k, v in sizes.items()}


def _training(sizes: dict[str, int], part: str, spec: str) -> TrainingAllocation:
    train = TrainingAllocation(**sizes)
    where = f"allocation_mode {spec!r}, part {part!r}"
    if train.vpp > 1 and train.pp == 1:
        raise AllocationError(f"{where}: virtual pipeline v{train.vpp} needs pipeline parallelism (p > 1), got p1")
    experts_group = train.ep * train.expert_tp
    if (train.dp * train.tp * train.cp) % experts_group:
        raise AllocationError(
            f"{where}: expert parallel e{train.ep} x expert tensor parallel et{train.expert_tp} = {experts_group} "
            f"must divide d{train.dp} x t{train.tp} x c{train.cp} = {train.dp * train.tp * train.cp}"
        )
    return train


def check_supported(alloc: AllocationMode) -> None:
    """Refuse what the grammar reads but megarl cannot run yet: pipeline parallelism inside an inference
    server (``p`` > 1 on the inference side). The launchers start tensor-parallel servers only.
    """
    inference = alloc.inference
    if inference is not None and inference.pp > 1:
        raise AllocationError(
            f"allocation_mode '{alloc}': {inference.backend} servers here are tensor-parallel only: pipeline "
            f"parallel p{inference.pp} is not started; use t{inference.tp * inference.pp} or more replicas (d)"
        )


def validate_allocation(
    alloc: AllocationMode,
    *,
    n_nodes: int | None = None,
    n_gpus_per_node: int | None = None,
    model: ModelShape | None = None,
) -> None:
    """Check ``alloc`` against the cluster and the model; raise :class:`AllocationError`.

    The cluster must hold exactly the devices the allocation uses. On several nodes
    the launcher gives inference and training whole nodes of their own, so each part
    must fill whole nodes, and no inference server may span nodes. Pipeline-parallel servers are
    refused (:func:`check_supported`).
    """
    check_supported(alloc)
    if n_nodes is not None and n_gpus_per_node is not None:
        _validate_cluster(alloc, n_nodes, n_gpus_per_node)
    if model is not None:
        validate_model(alloc, model)


def _validate_cluster(alloc: AllocationMode, n_nodes: int, per_node: int) -> None:
    total = n_nodes * per_node
    if alloc.world_size != total:
        raise AllocationError(
            f"allocation_mode '{alloc}' uses {_devices_sum(alloc)} devices, but the cluster has "
            f"{n_nodes} nodes x {per_node} GPUs per node = {total}"
        )
    inf = alloc.inference
    if inf is not None and inf.devices_per_server > per_node:
        raise AllocationError(
            f"allocation_mode '{alloc}': one {inf.backend} server needs t{inf.tp} x p{inf.pp} = "
            f"{inf.devices_per_server} devices, more than the {per_node} GPUs of one node"
        )
    if n_nodes > 1 and inf is not None and alloc.train is not None and not alloc.colocated:
        for name, part in (("inference", inf), ("training", alloc.train)):
            if part.world_size % per_node:
                raise AllocationError(
                    f"allocation_mode '{alloc}': on {n_nodes} nodes each part gets whole nodes, but the "
                    f"{name} part '{part}' uses {part.world_size} devices, not a multiple of {per_node} GPUs per node"
                )


def _devices_sum(alloc: AllocationMode) -> str:
    if alloc.colocated:
        return f"{alloc.world_size} (shared by '{alloc.inference}' and '{alloc.train}')"
    parts = [f"{p.world_size} ({p})" for p in (alloc.inference, alloc.train) if p is not None]
    return " + ".join(parts) + (f" = {alloc.world_size}" if len(parts) > 1 else "")


def validate_model(alloc: AllocationMode, model: ModelShape) -> None:
    """Check that the model's heads, layers and experts split evenly under ``alloc``."""
    if alloc.inference is not None:
        inf = alloc.inference
        _divides(inf.tp, model.num_attention_heads, f"{inf.backend} tensor parallel t{inf.tp}", "attention heads")
    train = alloc.train
    if train is None:
        return
    _divides(train.tp, model.num_attention_heads, f"megatron tensor parallel t{train.tp}", "attention heads")
    _divides(train.tp, model.num_key_value_heads, f"megatron tensor parallel t{train.tp}", "key/value heads")
    stages = train.pp * train.vpp
    _divides(stages, model.num_hidden_layers, f"pipeline p{train.pp} x virtual v{train.vpp} = {stages}", "layers")
    if train.ep > 1 and model.num_experts == 0:
        raise AllocationError(f"megatron expert parallel e{train.ep} is set, but the model has no experts (dense)")
    if model.num_experts:
        _divides(train.ep, model.num_experts, f"megatron expert parallel e{train.ep}", "experts")


def _divides(size: int, count: int, what: str, of: str) -> None:
    if count % size:
        raise AllocationError(f"{what} does not divide the model's {count} {of}")
