"""Load HF safetensors straight into this rank's Megatron shards; export shards back to HF.

Loading reads only the slices this rank's parameters need (``safe_open(...).get_slice``),
so no rank materialises the whole model. Export gathers each parameter over its
(expert) tensor-parallel group, converts it with the family mapping, and sends the
HF tensors of each pipeline stage / expert shard to global rank 0, which writes one
``model.safetensors`` (the layout of the source when the source is given, so that a
load → export round trip is byte-identical).

Parameter names are first made *canonical* (:func:`canonical_params`): global layer
numbers, global expert numbers, local-spec module names — the names the family
tables (``megarl.models.families``) are written in.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.models.build import ModelDesc
from megarl.models.mapping import export_from_shards, load_shard
from megarl.models.spec import canonical_name
from megarl.models.weight_files import INDEX_NAME, WEIGHTS_NAME, weight_files

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


@dataclass(frozen=True)
class ShardCoords:
    """This rank's position in the groups that shard parameters."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    def split_for(self, is_expert: bool) -> tuple[int, int]:
        """(rank, size) of the group a parameter is tensor-split over."""
        return (self.etp_rank, self.etp_size) if is_expert else (self.tp_rank, self.tp_size)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (``.module`` chains)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


ADAPTER_SUFFIXES = (".adapter.lora_a", ".adapter.lora_b")
"""How the canonical names of LoRA adapter matrices end (``megarl.models.lora``)."""


def canonical_params(chunk: torch.nn.Module, coords: ShardCoords) -> dict[str, torch.nn.Parameter]:
    """``{canonical name: parameter}`` of one model chunk (GPTModel, possibly wrapped)."""
    model = unwrap(chunk)
    experts_per_rank = None
    if getattr(model.config, "num_moe_experts", None):
        experts_per_rank = model.config.num_moe_experts // coords.ep_size
    out = {}
    for name, param in model.named_parameters():
        name = canonical_name(name)
        found = _LAYER_RE.match(name)
        if found:
            layer = model.decoder.layers[int(found.group(1))].layer_number - 1
            rest = found.group(2)
            expert = _EXPERT_RE.match(rest)
            if expert:
                global_expert = coords.ep_rank * experts_per_rank + int(expert.group(2))
                rest = f"{expert.group(1)}{global_expert}{expert.group(3)}"
            name = f"decoder.layers.{layer}.{rest}"
        out[name] = param
    return out


class SafetensorsReader:
    """Lazy slices of the tensors of an HF directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | os.PathLike):
        from safetensors import safe_open

        hf_dir = Path(hf_dir)
        self._handles = {}
        for file in weight_files(hf_dir):
            handle = safe_open(str(hf_dir / file), framework="pt")
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                self._handles[key] = handle

    def keys(self):
        return self._handles.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        if name not in self._handles:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        return self._handles[name].get_slice(name)

    def __call__(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        view = self._slice(name)
        if dim is None:
            return view[:]
        index = tuple([slice(None)] * dim + [slice(start, stop)])
        return view[index]


def load_hf_weights(chunks: list, desc: ModelDesc, hf_dir: str | os.PathLike, coords: ShardCoords) -> int:
    """Copy this rank's shards of the HF checkpoint into ``chunks``; returns the parameter count loaded."""
    reader = SafetensorsReader(hf_dir)
    left = desc.mapping.hf_names_not_loaded(reader.keys(), desc.tie_word_embeddings)
    if left:
        raise ValueError(
            f"{hf_dir} holds {len(left)} tensor(s) that megarl's {desc.family.name} layers have no place for "
            f"({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}): the model would lose them and differ "
            "from the checkpoint's (a config feature megarl does not support, or a checkpoint of another layout)"
        )
    loaded = 0
    with torch.no_grad():
        for chunk in chunks:
            for name, param in canonical_params(chunk, coords).items():
                rule, fields = desc.mapping.match(name)
                names = rule.hf_names(**fields)
                if rule.optional and names[0] not in reader.keys():
                    continue
                rank, size = coords.split_for(rule.is_expert)
                shard = load_shard(rule, names, reader, reader.shape(names[0]), rank, size, desc.dims)
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: HF shard {tuple(shard.shape)} != Megatron shard {tuple(param.shape)}")
                param.copy_(shard)
                loaded += 1
    logger.info("loaded %d parameter shards from %s", loaded, hf_dir)
    return loaded


def gather_hf_tensors(
    chunks: list,
    desc: ModelDesc,
    coords: ShardCoords,
    tp_group,
    etp_group,
    dtype: torch.dtype | None = None,
    value=None,
    include=None,
) -> dict[str, torch.Tensor]:
    """HF tensors of this rank's chunks, each gathered over its (expert) tensor-parallel group.

    Every rank of the TP / ETP group must call this (it all-gathers); all of them
    return the same full tensors. ``value(param)`` picks what is exported (default the
    parameter itself; e.g. ``lambda p: p.main_grad`` for gradients); ``include(rule)``
    skips rules (it must answer alike on all ranks of a TP / ETP group).
    """
    out = {}
    for chunk in chunks:
        for name, param in canonical_params(chunk, coords).items():
            if name.endswith(ADAPTER_SUFFIXES):  # LoRA matrices (megarl.models.lora) are no HF weights
                continue
            rule, fields = desc.mapping.match(name)
            if not rule.export or (include is not None and not include(rule)):
                continue
            group = etp_group if rule.is_expert else tp_group
            tensor = param.detach() if value is None else value(param)
            shards = _all_gather(tensor, group, rule.split == "replicated")
            tensors = export_from_shards(rule, rule.hf_names(**fields), shards, desc.dims)
            for hf_name, tensor in tensors.items():
                out[hf_name] = tensor.to(dtype or tensor.dtype).contiguous()
    return out


def _all_gather(tensor: torch.Tensor, group, replicated: bool) -> list[torch.Tensor]:
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1 or replicated:
        return [tensor.clone()]
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return [s.cpu() for s in shards]


def write_hf_dir(
    tensors: dict[str, torch.Tensor],
    out_dir: str | os.PathLike,
    hf_config=None,
    source_dir: str | os.PathLike | None = None,
) -> Path:
    """Write ``tensors`` as an HF directory; copies config / tokenizer files from ``source_dir``.

    With a sharded source (an index file), the same shard layout is reproduced.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layout = _source_layout(source_dir, tensors)
    for file, names in layout.items():
        save_file({n: tensors[n] for n in names}, str(out / file), metadata={"format": "pt"})
    if source_dir is not None:
        for path in Path(source_dir).iterdir():
            if path.is_file() and not path.name.endswith(".safetensors"):
                shutil.copyfile(path, out / path.name)
    elif hf_config is not None:
        hf_config.save_pretrained(out)
    logger.info("wrote %d HF tensors to %s", len(tensors), out)
    return out


def _source_layout(source_dir, tensors) -> dict[str, list[str]]:
    index = Path(source_dir) / INDEX_NAME if source_dir is not None else None
    if index is None or not index.exists():
        return {WEIGHTS_NAME: sorted(tensors)}
    weight_map = json.loads(index.read_text())["weight_map"]
    missing = sorted(set(tensors) - set(weight_map))
    if missing:
        raise ValueError(f"tensors not in the source index {index}: {missing[:5]}")
    layout: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if name in tensors:
            layout.setdefault(file, []).append(name)
    return layout
