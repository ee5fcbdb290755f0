"""Checkpoints of a MegatronEngine: HF export, and Megatron distributed checkpoints for resuming.

* :func:`export_hf` writes an HF directory (``model.safetensors`` + the source's config and
  tokenizer files) that ``transformers`` loads; global rank 0 writes, every rank calls.
* :func:`save` / :func:`load` write and read a Megatron distributed checkpoint
  (``megatron.core.dist_checkpointing``) of the model, the optimizer, the LR scheduler, the RNG
  states and the engine's version / step counters. Weights and optimizer state are recorded per
  parameter with their place in the whole tensor, so another layout (TP, PP, VPP, EP, ETP, CP, DP)
  loads them; the distributed optimizer's state only when written so (``optimizer.checkpoint_layout``).
  LoRA adapters are model parameters like the others, recorded with their tensor-parallel split
  (``megarl.models.lora``), their optimizer state with them.
"""

from __future__ import annotations

import copy
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from megarl.actor.optim import dither_main_params, use_fused_adam
from megarl.models.hf_io import gather_hf_tensors, unwrap, write_hf_dir

logger = logging.getLogger(__name__)


def export_hf(engine, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write the engine's weights as an HF directory at ``path`` (collective: every rank calls); with
    LoRA adapters, each adapted weight merged (``W + (alpha / r) B A``, as the servers get it)."""
    from megarl.models import lora
    from megarl.models.hf_io import canonical_params

    p = engine.parallel
    merged = lora.merged_weights(engine.model, engine.coords)
    names = {id(q): n for chunk in engine.model for n, q in canonical_params(chunk, engine.coords).items()}
    common = {
        "desc": engine.desc,
        "coords": engine.coords,
        "tp_group": p.tp_group,
        "etp_group": p.etp_group,
        "dtype": dtype,
        "value": lambda q: merged[names[id(q)]]() if names.get(id(q)) in merged else q.detach(),
    }
    # One replica of each tensor is gathered over TP / ETP; one TP / ETP peer sends it.
    dense = gather_hf_tensors(engine.model, include=lambda r: not r.is_expert and p.replica_rank == 0, **common)
    experts = gather_hf_tensors(engine.model, include=lambda r: r.is_expert and p.edp_rank == 0, **common)
    local = {**(dense if p.tp_rank == 0 else {}), **(experts if p.etp_rank == 0 else {})}
    parts = [None] * p.world_size if p.rank == 0 else None
    dist.gather_object(local, parts, dst=0)
    if p.rank == 0:
        tensors = {name: t for part in parts for name, t in part.items()}
        write_hf_dir(tensors, path, hf_config=engine.desc.hf_config, source_dir=engine.model_path)
    dist.barrier()


def export_peft(engine, path: str | os.PathLike, dtype: torch.dtype | None = None, for_servers: bool = False) -> None:
    """Write the engine's LoRA adapters as a PEFT adapter directory at ``path`` (collective: every rank
    calls), in ``dtype`` (None: the adapters' own); ``for_servers``: as :func:`megarl.models.lora.write_peft_dir`.
    Every rank returns after rank 0 has written, or failed to."""
    from megarl.models import lora

    p = engine.parallel
    full = lora.gather_full(engine.model, engine.coords)  # over each adapter's TP group
    local = full if p.tp_rank == 0 and p.replica_rank == 0 else {}
    parts = [None] * p.world_size if p.rank == 0 else None
    dist.gather_object(local, parts, dst=0)  # one copy per pipeline stage
    try:
        if p.rank == 0:
            tensors = {name: t for part in parts for name, t in part.items()}
            tensors = lora.peft_tensors(tensors, engine.desc, engine.config.lora.target_modules)
            if dtype is not None:
                tensors = {name: t.to(dtype) for name, t in tensors.items()}
            lora.write_peft_dir(tensors, engine.config.lora, engine.model_path, path, for_servers)
    finally:
        dist.barrier()  # a failed write raises on rank 0 only after the others are released


@dataclass(frozen=True)
class SaveLoadMeta:
    """What :meth:`MegatronEngine.save` / ``load`` write or read."""

    path: str
    """Checkpoint directory."""
    weight_format: Literal["megatron", "hf"] = "megatron"
    """``megatron``: a resumable distributed checkpoint; ``hf``: an HF directory (save only)."""
    with_optim: bool = True
    """Include optimizer, LR scheduler and RNG state (megatron format)."""


# The distributed optimizer's state in Megatron's formats (``optimizer.checkpoint_layout``): whole
# parameters, loadable at any layout; or per-bucket shards, parallel save / load, another DP size only.
# (0.16.1 rejects the flattened ranges of "fully_sharded_model_space".)
_OPTIMIZER_FORMATS = {"any": "fully_reshardable", "data_parallel": "dp_reshardable"}
_LAYOUT_KEYS = ("pp", "tp", "vpp")
_EXPERT_LAYOUT_KEYS = ("ep", "expert_tp")
"""What a ``dp_reshardable`` optimizer state must be loaded at as it was saved (its buckets' contents):
the layout keys, and the expert ones for a model with experts."""


def save(engine, meta: SaveLoadMeta) -> None:
    """Write ``engine``'s state to ``meta.path`` (collective)."""
    if meta.weight_format == "hf":
        export_hf(engine, meta.path)
        return
    from megatron.core import dist_checkpointing

    Path(meta.path).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state(engine, meta.with_optim, is_loading=False)
    dist_checkpointing.save(state, meta.path)
    logger.info("saved a Megatron distributed checkpoint to %s", meta.path)


@torch.no_grad()
def load(engine, meta: SaveLoadMeta) -> None:
    """Restore ``engine``'s state from ``meta.path`` (collective), written at any layout (the distributed
    optimizer's state: as ``optimizer.checkpoint_layout`` allows); another model is refused by name."""
    if meta.weight_format != "megatron":
        raise ValueError(f"load() reads weight_format 'megatron' checkpoints, got {meta.weight_format!r}")
    from megatron.core import dist_checkpointing

    if meta.with_optim and engine.optimizer is not None:
        _prime_adam_state(engine.optimizer)
    common = dist_checkpointing.load_common_state_dict(meta.path)
    saved = common["engine"]
    problem = model_problem(saved, _model_shape(engine))
    if problem is None and meta.with_optim and engine.optimizer is not None:
        problem = layout_problem(saved, engine.parallel.alloc)
    if problem is not None:
        raise ValueError(f"checkpoint {meta.path} {problem}")
    # a checkpoint from before checkpoint_layout existed holds per-bucket shards
    optimizer_format = saved.get("optimizer_format", "dp_reshardable")
    state = _sharded_state(engine, meta.with_optim, is_loading=True, optimizer_format=optimizer_format)
    saved_at = saved.get("model_parallel")
    if "rng_state" in state and saved_at is not None and saved_at != state["engine"]["model_parallel"]:
        # one RNG state per model-parallel rank: another layout has other ranks (weights and optimizer reshard)
        del state["rng_state"]
        logger.info(
            "the checkpoint was written at (PP, TP) %s, this run is %s: its RNG states are not restored",
            tuple(saved_at),
            tuple(state["engine"]["model_parallel"]),
        )
    loaded = dist_checkpointing.load(state, meta.path)
    for key, chunk in _chunk_keys(engine):
        unwrap(chunk).load_state_dict(loaded[key], strict=True)
    if meta.with_optim and engine.optimizer is not None:
        _load_optimizer_state(engine.optimizer, loaded["optimizer"], common["optimizer"])
        use_fused_adam(engine.optimizer)  # a state saved before the switch says fused=False
        _restore_adam_step(engine.optimizer, loaded["optimizer"])
        _dither_if_saved_undithered(engine, loaded["engine"].get("main_params_rounding", "nearest"))
        engine.lr_scheduler.load_state_dict(loaded["lr_scheduler"])
        if "rng_state" in loaded:
            set_rng_state(loaded["rng_state"])
    engine.set_version(int(loaded["engine"]["version"]))
    logger.info("loaded a Megatron distributed checkpoint from %s", meta.path)


_MODEL_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "vocab_size",
    "tie_word_embeddings",
)
"""The HF config entries that decide a checkpoint's tensors (those a config has)."""


def model_shape(hf_config: dict, lora=None) -> dict:
    """What decides the model a checkpoint holds: the entries of an HF config (``to_dict()``) that
    shape the model, and the LoRA adapters (a ``LoRAConfig``, or None): their tensors, and the scale
    their output is multiplied by (the same tensors at another scale are another model)."""
    shape = {key: hf_config[key] for key in _MODEL_KEYS if hf_config.get(key) is not None}
    if lora is not None and lora.rank > 0:
        shape["lora"] = {"rank": lora.rank, "target_modules": sorted(lora.target_modules), "scale": lora.scale}
    return shape


def _model_shape(engine) -> dict:
    return model_shape(engine.desc.hf_config.to_dict(), engine.config.lora)


def read_checkpoint_record(path: str | os.PathLike) -> dict:
    """What a checkpoint directory says of the engine that wrote it (version, layout, optimizer format,
    model shape); no process group needed."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(path))["engine"]


def model_problem(saved: dict, model: dict) -> str | None:
    """Why a checkpoint whose record (:func:`read_checkpoint_record`) is ``saved`` cannot load into an
    engine of ``model`` (:func:`model_shape`), or None (a record from before the shape was kept: None)."""
    keys = model_differences(saved, model)
    if not keys:
        return None
    known, model = _comparable(saved, model)
    differs = ", ".join(f"{k} {known.get(k)!r} -> {model.get(k)!r}" for k in keys)
    return (
        f"holds another model than this engine's ({differs}): load it with the model and adapters it was "
        f"trained with (actor.path, actor.lora; critic.* for a critic), or start fresh "
        f"(recover.mode=disabled, or another trial_name)"
    )


def model_differences(saved: dict, model: dict) -> list[str]:
    """The entries of :func:`model_shape` (``lora``, ``hidden_size``, ...) in which the checkpoint whose
    record is ``saved`` and an engine of ``model`` differ; none for a record from before the shape was kept."""
    known, model = _comparable(saved, model)
    return [k for k in sorted({*known, *model}) if known.get(k) != model.get(k)] if known else []


def _comparable(saved: dict, model: dict) -> tuple[dict, dict]:
    """The record's model shape and ``model`` as they compare: adapters recorded before their scale was
    compare without it."""
    known = saved.get("model") or {}
    if "lora" in model and "scale" not in known.get("lora", {}):
        model = {**model, "lora": {k: v for k, v in model["lora"].items() if k != "scale"}}
    return known, model


def holds_per_rank_optimizer(saved: dict) -> bool:
    """Whether the checkpoint whose record is ``saved`` holds the distributed optimizer's state as per-rank
    shards (``optimizer.checkpoint_layout: data_parallel``), which load at another data-parallel size only."""
    return (
        bool(saved.get("distributed_optimizer")) and saved.get("optimizer_format", "dp_reshardable") == "dp_reshardable"
    )


def layout_problem(saved: dict, layout) -> str | None:
    """Why a checkpoint whose record is ``saved`` cannot load with its optimizer state at ``layout`` (a
    ``TrainingAllocation``), or None: per-rank shards of the distributed optimizer load where their
    buckets are the same, at another data-parallel size only."""
    if not holds_per_rank_optimizer(saved):
        return None
    saved_layout = saved.get("layout") or dict(zip(("pp", "tp"), saved.get("model_parallel", ())))
    changed = {k: (v, getattr(layout, k)) for k, v in saved_layout.items() if getattr(layout, k) != v}
    if not changed:
        return None
    differs = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
    return (
        f"holds the distributed optimizer's state as per-rank shards (optimizer.checkpoint_layout=data_parallel), "
        f"which load at another data-parallel size only, and this engine's layout differs ({differs}): load it "
        f"at the layout that wrote it, convert a recover point (megarl convert-point, with the run's config), or "
        f"write the checkpoint with optimizer.checkpoint_layout=any"
    )


def _load_optimizer_state(optimizer, loaded, saved) -> None:
    """Load the optimizer's part of a checkpoint: ``loaded`` as ``dist_checkpointing.load`` returned it,
    ``saved`` the checkpoint's common (non-tensor) part of it."""
    if _sharding_type(saved) != "fully_reshardable":
        optimizer.load_state_dict(loaded)
        return
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    rest = _all_param_groups(saved)
    for opt, param_state in zip(chained, _param_states(loaded, len(chained)), strict=True):
        # param groups (torch's AdamW: with ``step`` put into every state); each optimizer its own copy
        opt.load_state_dict(copy.deepcopy(rest))
        if not HAVE_APEX_OR_TE:
            # Megatron 0.16.1 then copies every state entry, ``step`` included, from a source that has none
            # (``KeyError: 'step'``); _restore_adam_step puts the step back
            for each in opt.optimizer.state.values():
                each.pop("step", None)
        opt.load_parameter_state_from_fully_reshardable(param_state)


def _saved_parts(saved) -> list:
    """A checkpoint's common optimizer state, one entry per optimizer that wrote it (one, or the chained ones)."""
    return [saved] if "param_state_sharding_type" in saved else [v for _, v in sorted(saved.items())]


def _sharding_type(saved) -> str | None:
    """The distributed optimizer's format in a checkpoint's common optimizer state (None: not distributed)."""
    parts = _saved_parts(saved)
    return parts[0].get("param_state_sharding_type") if parts and isinstance(parts[0], dict) else None


def _param_states(loaded, n: int) -> list:
    """Each of this engine's ``n`` distributed optimizers' parameter states (as it asked for them)."""
    return [loaded["param_state"]] if n == 1 else [loaded[i]["param_state"] for i in range(n)]


def _all_param_groups(saved) -> dict:
    """What each distributed optimizer loads besides its parameter states: the saved param groups of
    every optimizer that wrote the checkpoint. Another expert-parallel size has another number of them
    (experts get an optimizer of their own when their data-parallel group differs); Megatron matches
    groups by their identifying keys (weight decay, LR multiplier, expert-parallel or not), so a group
    saved at expert-parallel size 1 also stands for its expert-parallel twin (same LR, step, decay)."""
    parts = _saved_parts(saved)
    groups = [group for part in parts for group in part["optimizer"]["param_groups"]]
    known = {_group_key(group) for group in groups}
    for group in list(groups):
        twin = {**group, "is_expert_parallel": not group.get("is_expert_parallel", False)}
        if _group_key(twin) not in known:
            groups.append(twin)
    whole = {**parts[0], "optimizer": {**parts[0]["optimizer"], "param_groups": groups}}
    whole.pop("param_state", None)
    return whole


def _layout_keys(engine) -> tuple[str, ...]:
    return _LAYOUT_KEYS + (_EXPERT_LAYOUT_KEYS if engine.desc.family.moe else ())


def _group_key(group: dict) -> tuple:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(key, group.get(f"pre_{key}")) for key in param_group_identifier_keys)


def _main_params_rounding(engine) -> str:
    """How the engine's bf16 / fp16 weights follow its main parameters (``none`` for fp32 weights)."""
    if engine.optimizer is None or engine.tconfig.params_dtype == torch.float32:
        return "none"
    return engine.config.optimizer.bf16_rounding


def _dither_if_saved_undithered(engine, saved: str) -> None:
    """Main parameters saved by a run that did not dither sit on (or near) the bf16 grid: dither
    them now if this run asks for it; the weights the model computes with stay as saved."""
    if _main_params_rounding(engine) == "dithered" and saved != "dithered":
        logger.info("dithering main parameters restored from a checkpoint saved with %r rounding", saved)
        dither_main_params(engine.optimizer, engine.tconfig.params_dtype)


def _prime_adam_state(optimizer) -> None:
    """Give a fresh torch AdamW its lazily created state (zeros, step 0) so Megatron can describe it.

    Without Apex / TE, Megatron's distributed optimizer reads ``step`` from the torch
    state when building the loading state dict, which a never-stepped AdamW lacks.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def _restore_adam_step(optimizer, loaded: dict) -> None:
    """Put the checkpoint's step count back into every torch AdamW state.

    Megatron 0.16.1's ``dp_reshardable`` load copies the freshly primed ``step`` (0) over
    the one it restored from ``param_groups`` (``_set_main_param_and_optimizer_states``),
    so the first update after a resume would use the wrong bias correction.
    """
    steps = {float(group["step"]) for group in _param_groups(loaded) if "step" in group}
    if not steps:
        return
    if len(steps) != 1:
        raise ValueError(f"checkpoint param_groups disagree on the optimizer step: {sorted(steps)}")
    step = steps.pop()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            # the fused kernel (use_fused_adam) keeps its step on the parameter's device
            on_device = any(group["fused"] or group["capturable"] for group in inner.param_groups)
            for param, state in inner.state.items():
                state["step"] = torch.tensor(step, dtype=torch.float32, device=param.device if on_device else "cpu")


def _param_groups(tree) -> list[dict]:
    """Every ``param_groups`` entry anywhere in a (chained) optimizer state dict."""
    if isinstance(tree, dict):
        found = list(tree.get("param_groups", [])) if isinstance(tree.get("param_groups"), list) else []
        return found + [g for k, v in tree.items() if k != "param_groups" for g in _param_groups(v)]
    if isinstance(tree, list | tuple):
        return [g for v in tree for g in _param_groups(v)]
    return []


def _chunk_keys(engine) -> list[tuple[str, torch.nn.Module]]:
    if len(engine.model) == 1:
        return [("model", engine.model[0])]
    return [(f"model{i}", chunk) for i, chunk in enumerate(engine.model)]


def _sharded_state(engine, with_optim: bool, is_loading: bool, optimizer_format: str | None = None) -> dict:
    """The checkpoint's state for ``dist_checkpointing``; ``optimizer_format``: the distributed optimizer's
    (Megatron's ``distrib_optim_sharding_type``; None: the one ``optimizer.checkpoint_layout`` asks for)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {key: unwrap(chunk).sharded_state_dict() for key, chunk in _chunk_keys(engine)}
    model_state = dict(state)
    alloc = engine.parallel.alloc
    distributed = engine.config.optimizer is not None and engine.config.optimizer.use_distributed_optimizer
    if optimizer_format is None:
        optimizer_format = _OPTIMIZER_FORMATS[engine.config.optimizer.checkpoint_layout] if distributed else None
    if with_optim and engine.optimizer is not None:
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            model_state,
            is_loading=is_loading,
            # whole parameters keyed by name alone, not by which of the chained optimizers holds them
            # (dense and expert weights have one optimizer or two, depending on the expert-parallel size)
            metadata={
                "distrib_optim_sharding_type": optimizer_format,
                "chained_optim_avoid_prefix": True,
                # gathered over gloo onto each DP group's first rank, not onto every rank (nor into GPU memory)
                "distrib_optim_fully_reshardable_mem_efficient": True,
            },
        )
        state["lr_scheduler"] = engine.lr_scheduler.state_dict()
        p = engine.parallel
        # one RNG state per model-parallel coordinate; data-parallel replicas share it on resume
        state["rng_state"] = ShardedObject(
            "rng_state", rng_state(), (alloc.pp, alloc.tp), (p.pp_rank, p.tp_rank), replica_id=p.replica_rank
        )
    state["engine"] = {
        "version": engine.get_version(),
        "main_params_rounding": _main_params_rounding(engine),
        "model_parallel": [alloc.pp, alloc.tp],  # the layout of rng_state
        "layout": {key: getattr(alloc, key) for key in _layout_keys(engine)},
        "model": _model_shape(engine),
        # a frozen engine (no optimizer: a reference model, a conversion) has no optimizer state
        "distributed_optimizer": distributed,
        "optimizer_format": optimizer_format,
    }
    return state


def rng_state() -> dict:
    """This process's Python, numpy, torch (+ CUDA) and Megatron RNG-tracker states."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state() -> tuple:
    """numpy's global RNG state with its key array as a tensor (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])
