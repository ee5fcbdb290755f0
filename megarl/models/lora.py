"""LoRA adapters on Megatron-Core's tensor-parallel linears, after Megatron-Bridge's ``ParallelLinearAdapter``.

An adapter sits beside its base linear ``W`` (a forward hook adds its output to the base's) and
computes ``(alpha / r) * B A dropout(x)`` with ``A: [r, in]`` and ``B: [out, r]``. Parameter names
gain ``.adapter.lora_a`` / ``.adapter.lora_b`` after the base's module name; the base's own
names do not change, so the HF mapping, loading and the Megatron checkpoints of the base model
are untouched. How ``A`` and ``B`` are split over the base's tensor-parallel group:

==================  ===================  ===================  ==================================
base                A ``[r, in]``        B ``[out, r]``       communication (rank-``r`` tensors)
==================  ===================  ===================  ==================================
column-parallel     replicated           column (output dim)  backward all-reduce of ``A x``
(``linear_qkv``,                         (``linear_fc1``:     (sequence parallel: all-gather of
``linear_fc1``)                          each rank's gate     ``A x`` along the sequence, reduce-
                                         and up rows)         scatter backward; ``A``'s gradient
                                                              joins the norms' TP all-reduce)
row-parallel        row (input dim)      replicated           all-reduce of ``A x``; sequence
(``linear_proj``,                                             parallel: the output is scattered
``linear_fc2``)                                               along the sequence as the base's
==================  ===================  ===================  ==================================

The adapter's communication is its own, on ``r``-wide tensors, instead of riding on the base's
(``r / hidden`` of the base's traffic); so each replicated matrix gets the same gradient on every
rank and needs no extra reduction. Expert linears of MoE layers run without tensor-parallel
communication of their own (the token dispatcher does it): their adapters are supported with
expert tensor parallelism 1, where they are plain local matrices.

Dropout masks come from torch's default generator, which every tensor-parallel rank seeds alike
(``megarl.actor.parallel.seed_everything``): a replicated ``A`` sees the same mask on every rank,
so its replicas get the same gradient.

Initial values are drawn per parameter from its canonical name (global layer and expert) as
full matrices, then split: the same adapter whatever the parallel layout. :func:`peft_tensors`
and :func:`peft_full` convert full adapters to and from a PEFT adapter directory through the
family's HF mapping (the fused ``linear_qkv`` / ``linear_fc1`` share one ``A`` over their HF modules).

:func:`merged_weight` gives an adapted linear's ``W + (alpha / r) B A`` for this rank's shard (what the
weight bridge sends the servers, and the HF export writes): each rank's part is its own ``B`` times its
own ``A`` in every split above. In Megatron's distributed checkpoints each adapter matrix is recorded
with its split (the base linear's ``sharded_state_dict`` is extended per adapted linear), so the
optimizer state of the adapters, which follows the model's sharding metadata, is saved whole too.

Why not Megatron-Bridge's PEFT (``megatron-bridge`` 0.3.1, the release on PyPI): its
``megatron/bridge/peft/lora.py`` and ``lora_layers.py`` import ``transformer_engine.pytorch`` at
module level (``ModuleNotFoundError: No module named 'transformer_engine'`` on a CPU-only
install with megatron-core 0.16.1), and the wheel requires ``transformer-engine[core_cu13,pytorch]
>=2.10``, ``transformers<5.0.0`` (megarl runs transformers 5), ``mamba-ssm``, ``causal-conv1d`` and
``nvidia-resiliency-ext``: CUDA builds, or a conflict with megarl's own requirements. Its ``ParallelLinearAdapter``
(``megatron/bridge/peft/utils.py``) imports, but it reads Megatron's global process groups
(megarl passes them explicitly) and its checkpoint layout is tied to Bridge's own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel as tpl
from megatron.core.tensor_parallel import mappings

from megarl.models.build import ModelDesc
from megarl.models.hf_io import ShardCoords, canonical_params, unwrap
from megarl.models.mapping import export_from_shards, load_shard
from megarl.models.peft_files import HF_LORA_TARGETS, PEFT_CONFIG, PEFT_WEIGHTS, adapter_problems, hf_module

logger = logging.getLogger(__name__)

AdapterSplit = Literal["replicated", "column", "row", "gate_up"]


class LoRASettings(Protocol):
    """What building adapters reads (``megarl.config.train.LoRAConfig`` has it)."""

    rank: int
    alpha: float
    use_rslora: bool
    scale: float
    dropout: float
    target_modules: list[str]


@dataclass(frozen=True)
class AdapterParam:
    """One adapter matrix on this rank: its canonical name, how it is split, and over which group."""

    name: str
    param: torch.nn.Parameter
    split: AdapterSplit
    group: object
    rank: int
    size: int


class LoRAAdapter(torch.nn.Module):
    """``(alpha / r) * B A dropout(x)`` beside one Megatron column- or row-parallel linear.

    ``row_blocks`` (a column-parallel base holding several HF modules, each adapted on its own): the block
    of each row of this rank's shard of ``W`` (-1: a module without an adapter). Then ``A`` stacks one
    ``[r, in]`` matrix per block and each row of ``B`` has ``r`` values, in its block's columns (the rest
    masked to zero): PEFT's adapter per HF module, computed as one adapter of rank ``blocks * r``."""

    def __init__(
        self,
        base: torch.nn.Module,
        rank: int,
        scale: float,
        dropout: float,
        gated: bool,
        row_blocks: torch.Tensor | None = None,
    ):
        super().__init__()
        self.row = isinstance(base, tpl.RowParallelLinear)
        self.group = base.tp_group  # the expert-TP group on an expert linear
        self.size, self.tp_rank = self.group.size(), self.group.rank()
        if base.explicit_expert_comm and self.size > 1:
            raise ValueError(
                "LoRA on expert linears needs expert tensor parallelism 1 "
                f"(got {self.size}): set the allocation's expert TP to 1, or leave experts out of target_modules"
            )
        self.local = base.explicit_expert_comm or self.size == 1  # no communication of its own
        self.sequence_parallel = bool(base.sequence_parallel) and not self.local
        self.scale = scale
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        out_local, in_local = base.weight.shape
        dtype, device = base.weight.dtype, base.weight.device
        blocks = 1 if row_blocks is None else int(row_blocks.max()) + 1
        self.lora_a = torch.nn.Parameter(torch.zeros(blocks * rank, in_local, dtype=dtype, device=device))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_local, blocks * rank, dtype=dtype, device=device))
        mask = None
        if row_blocks is not None:
            column_blocks = torch.arange(blocks * rank, device=device) // rank
            mask = (row_blocks.to(device)[:, None] == column_blocks[None, :]).to(dtype)
        self.register_buffer("b_mask", mask, persistent=False)
        self.splits: dict[str, AdapterSplit] = (
            {"lora_a": "row", "lora_b": "replicated"}
            if self.row
            else {"lora_a": "replicated", "lora_b": "gate_up" if gated else "column"}
        )
        self._tag(base)

    def _tag(self, base: torch.nn.Module) -> None:
        """Megatron's parameter attributes: which are split (grad norm), expert-parallel (DDP
        groups), and which sum over TP (``A`` of a column adapter under sequence parallelism)."""
        for name, param in (("lora_a", self.lora_a), ("lora_b", self.lora_b)):
            split = self.splits[name]
            is_split = split != "replicated" or self.local
            tpl.set_tensor_model_parallel_attributes(param, is_split, 1 if split == "row" else 0, 1)
            param.allreduce = getattr(base.weight, "allreduce", True)
        self.lora_a.sequence_parallel = self.sequence_parallel and not self.row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the base linear's input ``[s, b, in]`` (its shard); returns what adds to its output."""
        x = self.dropout(x)
        h = x @ self.lora_a.t()  # [s, b, r]: partial over TP when row-parallel
        if self.row and not self.local:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.group)
        elif self.sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(h, group=self.group)
        elif not self.local:
            h = mappings.copy_to_tensor_model_parallel_region(h, group=self.group)
        out = (h @ self.b().t()) * self.scale
        if self.row and self.sequence_parallel:
            out = mappings.scatter_to_sequence_parallel_region(out, group=self.group)
        return out

    def b(self) -> torch.Tensor:
        """``B`` as the adapter computes with it: each row's values outside its block masked to zero."""
        return self.lora_b if self.b_mask is None else self.lora_b * self.b_mask


def _add_adapter_output(module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + module.adapter(x).to(out.dtype), bias


def _input_requires_grad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A frozen embedding's output needs no gradient, so a reentrant activation checkpoint around the
    first layer (Megatron's full recompute) would pass none to the adapters inside it: ask for one."""
    return output.requires_grad_(True)


def _target_name(name: str) -> str:
    """What ``target_modules`` calls the module at ``name``: its last part, after ``experts.`` in a routed expert."""
    last = name.rsplit(".", 1)[-1]
    return f"experts.{last}" if ".experts." in name and ".shared_experts." not in name else last


def _require_local_linear(name: str, module: torch.nn.Module) -> None:
    if type(module) not in (tpl.ColumnParallelLinear, tpl.RowParallelLinear):
        raise ValueError(
            f"LoRA wraps Megatron's own column- and row-parallel linears; {name} is a {type(module).__name__} "
            "(TransformerEngine layers are not supported yet: set megatron.use_transformer_engine=false)"
        )


def _module_blocks(names: tuple[str, ...], targets) -> tuple[int | None, ...]:
    """The adapter block of each HF module of a linear (``names``: its HF weights) whose HF name is among
    ``targets`` (PEFT's names, :data:`~megarl.models.peft_files.HF_LORA_TARGETS`), numbered in order; None
    for the others."""
    blocks, count = [], 0
    for name in names:
        blocks.append(count if hf_module(name) in targets else None)
        count += blocks[-1] is not None
    return tuple(blocks)


def _row_blocks(linear, rule, names: tuple[str, ...], blocks: tuple, coords: ShardCoords, desc: ModelDesc):
    """The block of each row of this rank's shard of a fused linear's weight (-1: its module has no adapter):
    the block numbers laid out by the family's mapping as it lays out the HF weights' rows."""
    rank, size = coords.split_for(rule.is_expert)
    out_first = linear.weight.shape[0] * size // len(names)  # the first HF module's rows (gate_up's halves)

    def read(name, dim, start, stop):
        block = blocks[names.index(name)]
        return torch.full((stop - start,), -1 if block is None else block, dtype=torch.long)

    return load_shard(rule, names, read, (out_first,), rank, size, desc.dims)


def _adapter_form(linear, target: str, targets: set, canonical: str, desc: ModelDesc, coords: ShardCoords):
    """How a linear is adapted: the targets that name it (empty: no adapter) and, with an adapter per targeted
    HF module inside a fused linear, the block of each of its rows (None: one adapter)."""
    if target in targets:
        return {target}, None
    if target not in HF_LORA_TARGETS.values():  # an expert linear, or no linear: Megatron names only
        return set(), None
    rule, fields = desc.mapping.match(canonical)
    names = rule.hf_names(**fields)
    blocks = _module_blocks(names, targets)
    named = {hf_module(name) for name, block in zip(names, blocks) if block is not None}
    if not named or len(names) == 1:
        return named, None
    return named, _row_blocks(linear, rule, names, blocks, coords, desc)


def add_adapters(chunks: list, settings: LoRASettings, desc: ModelDesc, coords: ShardCoords) -> int:
    """Give every targeted linear of ``chunks`` an adapter and freeze everything else; returns
    the number of adapters. Call after the base weights are loaded and before the DDP wrap, so
    that Megatron's DDP and optimizer see only the adapters as trainable."""
    targets = set(settings.target_modules)
    count, matched = 0, set()
    for chunk in chunks:
        model = unwrap(chunk)
        model.requires_grad_(False)
        if getattr(model, "pre_process", False):
            model.embedding.register_forward_hook(_input_requires_grad)
        gated = bool(model.config.gated_linear_unit)
        canonical = {id(param): name for name, param in canonical_params(chunk, coords).items()}
        for name, module in list(model.named_modules()):
            weight = getattr(module, "weight", None)
            if weight is None or id(weight) not in canonical:
                continue
            named, row_blocks = _adapter_form(module, _target_name(name), targets, canonical[id(weight)], desc, coords)
            if not named:
                continue
            matched |= named
            _require_local_linear(name, module)
            fc1 = name.endswith("linear_fc1")
            module.adapter = LoRAAdapter(
                module, settings.rank, settings.scale, settings.dropout, gated and fc1, row_blocks
            )
            module.register_forward_hook(_add_adapter_output, with_kwargs=True)
            module.sharded_state_dict = partial(_sharded_state_dict, module, module.sharded_state_dict)
            count += 1
    if count == 0:
        raise ValueError(f"lora.target_modules {list(settings.target_modules)} matched no linear of this model")
    if targets - matched:  # a MoE model has no dense MLP: its experts are experts.linear_fc1 / _fc2
        logger.warning("lora.target_modules %s matched no linear of this model: not adapted", sorted(targets - matched))
    return count


def _sharded_state_dict(linear, base_method, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
    """The linear's Megatron checkpoint entries with its adapter's split recorded: the base
    linear's own method takes every tensor it does not know as replicated over TP, so each split
    adapter matrix is described here as its base is (``B`` of ``linear_fc1`` as the gate / up halves
    of its weight), which Megatron's optimizer state follows too."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    out = base_method(prefix, sharded_offsets, metadata)
    adapter = linear.adapter
    tensors = {f"adapter.{which}": getattr(adapter, which) for which in adapter.splits}
    axes = {f"adapter.{w}": 1 if s == "row" else 0 for w, s in adapter.splits.items() if s != "replicated"}
    out.update(
        make_sharded_tensors_for_checkpoint(
            tensors, prefix, axes, sharded_offsets, tp_group=linear.tp_group, dp_cp_group=metadata["dp_cp_group"]
        )
    )
    if adapter.splits["lora_b"] == "gate_up":  # as Megatron's MLP treats linear_fc1.weight
        key = f"{prefix}adapter.lora_b"
        singleton = (metadata or {}).get("singleton_local_shards", False)
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
    return out


@torch.no_grad()
def merged_weight(linear: torch.nn.Module) -> torch.Tensor:
    """``W + (alpha / r) B A`` of an adapted linear: a new tensor shaped and split as this rank's
    shard of ``W``, in its dtype (the sum in fp32, rounded once). Each rank's part of the product is
    its own ``B`` times its own ``A``, whatever the split: a column-parallel base has ``A`` whole and
    the rows of ``B`` it holds of ``W`` (for ``linear_qkv`` Megatron's grouped query / key / value rows,
    for ``linear_fc1`` its gate rows then its up rows, as the adapter's output adds to the base's);
    a row-parallel base has ``B`` whole and the columns of ``A`` it holds of ``W``. ``W`` is not written."""
    adapter, base = linear.adapter, linear.weight.detach()
    a, b = adapter.lora_a.detach().float(), adapter.b().detach().float()
    return torch.addmm(base.float(), b, a, alpha=adapter.scale).to(base.dtype)


def merged_weights(chunks: list, coords: ShardCoords) -> dict[str, Callable[[], torch.Tensor]]:
    """``{canonical name of an adapted base weight: a call that returns its merged shard}`` (:func:`merged_weight`);
    empty without adapters. Nothing is computed until a call."""
    out = {}
    for chunk in chunks:
        canonical = {id(param): name for name, param in canonical_params(chunk, coords).items()}
        for module in unwrap(chunk).modules():
            if isinstance(getattr(module, "adapter", None), LoRAAdapter):
                out[canonical[id(module.weight)]] = partial(merged_weight, module)
    return out


def adapter_params(chunks: list, coords: ShardCoords) -> Iterator[AdapterParam]:
    """This rank's adapter matrices with their canonical names (global layer and expert numbers)."""
    for chunk in chunks:
        canonical = {id(param): name for name, param in canonical_params(chunk, coords).items()}
        for module in unwrap(chunk).modules():
            if not isinstance(module, LoRAAdapter):
                continue
            for which in ("lora_a", "lora_b"):
                param = getattr(module, which)
                split = module.splits[which]
                yield AdapterParam(canonical[id(param)], param, split, module.group, module.tp_rank, module.size)


def shard(full: torch.Tensor, split: AdapterSplit, rank: int, size: int) -> torch.Tensor:
    """This rank's part of a full adapter matrix (``gate_up``: its gate rows, then its up rows)."""
    if split == "replicated" or size == 1:
        return full
    if split == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=0 if split == "column" else 1)[rank]


def unshard(shards: list[torch.Tensor], split: AdapterSplit) -> torch.Tensor:
    """The full matrix from every rank's part (the inverse of :func:`shard`)."""
    if split == "replicated" or len(shards) == 1:
        return shards[0]
    if split == "gate_up":
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat([*gates, *ups])
    return torch.cat(shards, dim=0 if split == "column" else 1)


def full_shape(item: AdapterParam) -> tuple[int, int]:
    """The shape of the whole matrix ``item`` holds a part of."""
    rows, cols = item.param.shape
    if item.split in ("column", "gate_up"):
        return rows * item.size, cols
    if item.split == "row":
        return rows, cols * item.size
    return rows, cols


def _local_parts(
    chunks: list, coords: ShardCoords, full_of: Callable
) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """``(adapter matrix, this rank's part of full_of(canonical name, full shape))`` for every adapter of ``chunks``."""
    for item in adapter_params(chunks, coords):
        yield item.param, shard(full_of(item.name, full_shape(item)), item.split, item.rank, item.size)


@torch.no_grad()
def load_full(chunks: list, coords: ShardCoords, full_of: Callable[[str, tuple[int, int]], torch.Tensor]) -> None:
    """Set every adapter matrix from ``full_of(canonical name, full shape)`` (a full matrix), split for this rank."""
    for param, part in _local_parts(chunks, coords, full_of):
        param.copy_(part)


def gather_full(chunks: list, coords: ShardCoords, value=None) -> dict[str, torch.Tensor]:
    """``{canonical name: full matrix}`` of this rank's adapters (``value(param)``: e.g. its ``main_grad``),
    gathered over each adapter's tensor-parallel group (collective over those groups)."""
    out = {}
    for item in adapter_params(chunks, coords):
        tensor = (item.param.detach() if value is None else value(item.param)).contiguous()
        shards = [tensor.clone()]  # not a view of Megatron's parameter buffer: pickled, a view carries all of it
        if item.size > 1 and item.split != "replicated":
            shards = [torch.empty_like(tensor) for _ in range(item.size)]
            dist.all_gather(shards, tensor, group=item.group)
        out[item.name] = unshard([s.cpu() for s in shards], item.split)
    return out


def peft_init(seed: int = 0) -> Callable[[str, tuple[int, int]], torch.Tensor]:
    """PEFT's initial adapter: ``A`` Kaiming-uniform (``a = sqrt(5)``), ``B`` zero; drawn from ``seed``
    and the matrix's canonical name, so every layout starts from the same full matrices."""

    def full_of(name: str, shape: tuple[int, int]) -> torch.Tensor:
        if name.endswith("lora_b"):
            return torch.zeros(shape)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound

    return full_of


def _blocks_of(prefix: str, names: tuple[str, ...], targets) -> tuple[int | None, ...] | None:
    """The adapter block of each HF module of the adapted linear ``prefix`` (:func:`_module_blocks`), or None
    when it has one adapter for all of them (its Megatron name is targeted, or it holds one module)."""
    if len(names) == 1 or _target_name(prefix) in targets:
        return None
    return _module_blocks(names, targets)


def peft_tensors(full: dict[str, torch.Tensor], desc: ModelDesc, targets) -> dict[str, torch.Tensor]:
    """PEFT's tensors (``base_model.model.<HF module>.lora_A.weight`` / ``lora_B``) of full adapters named
    canonically, on ``targets`` (``lora.target_modules``). An adapter per HF module gives each its ``A``
    and its rows of ``B`` in its block's columns; a fused linear's one adapter gives its ``A`` to each of
    its HF modules (``q_proj``, ``k_proj`` and ``v_proj`` share it) and its ``B`` split into theirs by the
    family's HF mapping. Exact either way."""
    out = {}
    for prefix in sorted({name.rsplit(".adapter.", 1)[0] for name in full}):
        rule, fields = desc.mapping.match(f"{prefix}.weight")
        if rule.is_expert:
            raise NotImplementedError(f"PEFT export of expert adapters ({prefix}) is not supported yet")
        names = rule.hf_names(**fields)
        a = full[f"{prefix}.adapter.lora_a"]
        b_parts = export_from_shards(rule, names, [full[f"{prefix}.adapter.lora_b"]], desc.dims)
        blocks = _blocks_of(prefix, names, targets)
        rank = a.shape[0] // (1 if blocks is None else sum(j is not None for j in blocks))
        for i, (hf_name, b) in enumerate(b_parts.items()):
            module = f"base_model.model.{hf_name.removesuffix('.weight')}"
            if blocks is None:  # one A for all; .clone(): no shared storage on disk
                out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a.clone(), b.contiguous()
            elif blocks[i] is not None:
                cols = slice(blocks[i] * rank, (blocks[i] + 1) * rank)
                out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = (
                    a[cols].clone(),
                    b[:, cols].contiguous(),
                )
    return out


def write_peft_dir(
    tensors: dict[str, torch.Tensor],
    settings: LoRASettings,
    base_model: str,
    out_dir: str | os.PathLike,
    for_servers: bool = False,
) -> Path:
    """Write ``tensors`` (:func:`peft_tensors`) and their ``adapter_config.json`` as a PEFT adapter directory.

    ``for_servers``: the scale written as plain ``lora_alpha / r`` (``lora_alpha`` = scale x ``r``, no
    ``use_rslora``), which every server reads alike (SGLang ignores ``use_rslora``); else as configured,
    which PEFT and ``init_from`` read back as it was."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "use_rslora": settings.use_rslora,
        "lora_dropout": settings.dropout,
        "target_modules": sorted({name.split(".")[-3] for name in tensors}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    if for_servers and settings.use_rslora:
        config["lora_alpha"] = settings.scale * settings.rank
        config["use_rslora"] = False
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def peft_full(path: str | os.PathLike, desc: ModelDesc, settings: LoRASettings) -> Callable:
    """``full_of`` for :func:`load_full` from a PEFT adapter directory (PEFT's, or what :func:`write_peft_dir`
    writes). An adapter per HF module (HF names in ``target_modules``) takes each module's ``lora_A`` and
    ``lora_B`` as they are; one adapter of a fused linear (its Megatron name) takes the ``lora_A`` its HF
    modules share (they must be equal) and their ``lora_B``, merged by the family's HF mapping. What the
    directory holds beyond ``target_modules``, or settings megarl's adapters cannot hold, is refused."""
    from safetensors.torch import load_file

    path = Path(path)
    problems = adapter_problems(path, settings, desc.family.moe, "lora")
    if problems:
        raise ValueError("; ".join(f"{key}: {why}" for key, why in problems))
    tensors = load_file(str(path / PEFT_WEIGHTS))

    def peft_tensor(module_weight: str, which: str) -> torch.Tensor:
        key = f"base_model.model.{module_weight.removesuffix('.weight')}.{which}.weight"
        if key not in tensors:
            raise ValueError(f"lora.init_from={path}: no {key} in {PEFT_WEIGHTS} (its target_modules differ?)")
        return tensors[key]

    def shared_a(prefix: str, names: tuple[str, ...]) -> torch.Tensor:
        a = [peft_tensor(hf_name, "lora_A") for hf_name in names]
        if any(not torch.equal(a[0], other) for other in a[1:]):
            modules = [hf_module(n) for n in names]
            raise ValueError(
                f"lora.init_from={path}: {', '.join(names)} have different lora_A, but the target "
                f"{_target_name(prefix)} gives the fused {prefix} one A: name its HF modules in "
                f"actor.lora.target_modules ({', '.join(modules)}) for an adapter each (docs/guides/lora.md)"
            )
        return a[0]

    def b_rows(names: tuple[str, ...], blocks, width: int):
        """Reads each HF module's ``lora_B`` rows in its block's columns of a ``width``-wide ``B`` (zeros for
        a module without an adapter), for :func:`load_shard`."""

        def read(hf_name, dim, start, stop):
            block = None if blocks is None else blocks[names.index(hf_name)]
            if blocks is not None and block is None:
                return torch.zeros(stop - start, width)
            b = peft_tensor(hf_name, "lora_B")
            b = b if dim is None else b.narrow(dim, start, stop - start)
            if blocks is None:
                return b
            return torch.nn.functional.pad(b, (block * settings.rank, width - (block + 1) * settings.rank))

        return read

    def full_of(name: str, shape: tuple[int, int]) -> torch.Tensor:
        prefix, which = name.rsplit(".adapter.", 1)
        rule, fields = desc.mapping.match(f"{prefix}.weight")
        names = rule.hf_names(**fields)
        blocks = _blocks_of(prefix, names, settings.target_modules)
        if which == "lora_a" and blocks is None:
            full = shared_a(prefix, names)
        elif which == "lora_a":
            full = torch.cat([peft_tensor(n, "lora_A") for n, j in zip(names, blocks) if j is not None])
        else:
            first = next(n for i, n in enumerate(names) if blocks is None or blocks[i] is not None)
            out_first = peft_tensor(first, "lora_B").shape[0]
            full = load_shard(rule, names, b_rows(names, blocks, shape[1]), (out_first, shape[1]), 0, 1, desc.dims)
        if tuple(full.shape) != tuple(shape):
            raise ValueError(f"lora.init_from={path}: {name} is {tuple(full.shape)} on disk, {tuple(shape)} here")
        return full

    return full_of


def initial_full(settings: LoRASettings, desc: ModelDesc) -> Callable[[str, tuple[int, int]], torch.Tensor]:
    """``full_of`` of the adapters a run starts from: ``settings.init_from``'s (a PEFT directory), else
    PEFT's initialisation (``B = 0``: the base model)."""
    return peft_full(settings.init_from, desc, settings) if settings.init_from else peft_init()


def add_and_load_adapters(chunks: list, settings: LoRASettings, desc: ModelDesc, coords: ShardCoords) -> int:
    """Adapters on ``chunks`` (:func:`add_adapters`), started from :func:`initial_full`; the number of adapters."""
    n_adapters = add_adapters(chunks, settings, desc, coords)
    load_full(chunks, coords, initial_full(settings, desc))
    trainable = sum(q.numel() for chunk in chunks for q in chunk.parameters() if q.requires_grad)
    logger.info(
        "LoRA: %d adapters (rank %d), %d trainable parameters on this rank", n_adapters, settings.rank, trainable
    )
    return n_adapters


def initial_values(chunks: list, coords: ShardCoords, settings: LoRASettings, desc: ModelDesc) -> list[tuple]:
    """``(parameter, this rank's part of its initial value)`` for every adapter matrix of ``chunks``: what
    :func:`add_and_load_adapters` loaded, in the parameter's dtype, also after a resume (the run's adapters
    have trained since; these are read again from where they started)."""
    return [(param, part.to(param.dtype)) for param, part in _local_parts(chunks, coords, initial_full(settings, desc))]


@contextlib.contextmanager
def holding(values: list[tuple]) -> Iterator[None]:
    """Inside the block each parameter holds the value paired with it (:func:`initial_values`); after it, its
    own again, bit for bit."""
    with torch.no_grad():
        kept = [param.detach().clone() for param, _ in values]
        for param, value in values:
            param.copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for (param, _), own in zip(values, kept):
                param.copy_(own)
