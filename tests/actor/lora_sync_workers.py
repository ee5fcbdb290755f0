"""What the LoRA weight-sync and checkpoint tests run on each rank (see ``dist_utils.run_ranks``)."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from megarl.config.train import LoRAConfig
from tests.actor.lora_workers import ALPHA, DENSE, RANK, _lora_engine, nonzero_adapter
from tests.actor.workers import optimizer_state_per_param, ppo_token_loss, split_rows, token_weight


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's own state on this rank: its main parameters and their Adam states."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                out.append(param.detach())
                state = inner.state[param]
                out += [state[key] for key in sorted(state) if isinstance(state[key], torch.Tensor)]
    return out


def lora_sync_run(
    model_dir: str, alloc: str, batch: dict, out_dir: str, distributed_optimizer: bool, targets: list[str] = DENSE
) -> dict:
    """One Adam step from :func:`nonzero_adapter`'s adapters, then: the HF tensors the weight bridge
    gathers (merged), whether the base weights kept their bits, the PEFT and merged HF exports, and a
    checkpoint saved, perturbed and loaded (adapters and optimizer state before and after)."""
    from megarl.actor.checkpoint import SaveLoadMeta
    from megarl.bridge.source import ShardSource
    from megarl.bridge.transfer_plan import enumerate_sources
    from megarl.models import lora

    out = Path(out_dir)
    settings = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets)
    engine = _lora_engine(model_dir, alloc, settings, 2, distributed_optimizer, False, sequence_parallel=True)
    p = engine.parallel
    lora.load_full(engine.model, engine.coords, nonzero_adapter)
    engine.train_batch(split_rows(batch, p.dp_rank, p.alloc.dp), ppo_token_loss, token_weight)

    adapter_ids = {id(item.param) for item in lora.adapter_params(engine.model, engine.coords)}
    base = [q for chunk in engine.model for q in chunk.parameters() if id(q) not in adapter_ids]
    base_before = [q.detach().clone() for q in base]
    source = ShardSource.from_engine(engine)
    merged = {}
    for src in enumerate_sources(engine.desc.mapping, engine.desc.hf_config, p.alloc):
        if src.rule.export:
            merged.update(source.gather_hf(src))
    name = next(iter(source.merged))
    result = {
        "n_merged": len(source.merged),
        "cached": source.local(name) is source.local(name),
        "base_bits_kept": all(torch.equal(a, q.detach()) for a, q in zip(base_before, base)),
        "merged": merged if p.rank == 0 else None,
    }
    full = lora.gather_full(engine.model, engine.coords)  # what the PEFT export sends to rank 0, pickled
    result["adapter_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    result["pickled_bytes"] = len(pickle.dumps(full))
    engine.export_adapters(str(out / "peft"))
    engine.export_hf(str(out / "hf"))

    engine.set_version(7)
    meta = SaveLoadMeta(str(out / "ckpt"))
    engine.save(meta)
    adapters = [item.param.detach().clone() for item in lora.adapter_params(engine.model, engine.coords)]
    optim = [t.clone() for t in _optimizer_tensors(engine.optimizer)]
    with torch.no_grad():
        for item in lora.adapter_params(engine.model, engine.coords):
            item.param.add_(1.0)
        for tensor in _optimizer_tensors(engine.optimizer):
            tensor.add_(0.5)
    engine.set_version(0)
    result["perturbed"] = not any(torch.equal(a, t) for a, t in zip(optim, _optimizer_tensors(engine.optimizer)))
    engine.load(meta)
    after = [item.param.detach() for item in lora.adapter_params(engine.model, engine.coords)]
    result["n_adapters"], result["n_optim"] = len(adapters), len(optim)
    result["adapters_restored"] = all(torch.equal(a, b) for a, b in zip(adapters, after))
    result["optim_restored"] = all(torch.equal(a, b) for a, b in zip(optim, _optimizer_tensors(engine.optimizer)))
    result["version"] = engine.get_version()
    result["base_after_load"] = all(torch.equal(a, q.detach()) for a, q in zip(base_before, base))
    return result


def lora_checkpoint_at(
    model_dir: str, alloc: str, batch: dict, ckpt: str, save: bool, distributed: bool = False, targets=DENSE
) -> dict:
    """``save``: one Adam step from :func:`nonzero_adapter`'s adapters at ``alloc``, then a checkpoint; else a
    fresh engine at ``alloc`` loads it. Either way, on rank 0: the full adapters and the full Adam moments of
    each (gathered over tensor parallelism), and the optimizer's step."""
    from megarl.actor.checkpoint import SaveLoadMeta
    from megarl.models import lora

    settings = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets)
    engine = _lora_engine(model_dir, alloc, settings, 2, distributed, False, sequence_parallel=True)
    p = engine.parallel
    inner = engine.optimizer.optimizer
    if save:
        lora.load_full(engine.model, engine.coords, nonzero_adapter)
        engine.train_batch(split_rows(batch, p.dp_rank, p.alloc.dp), ppo_token_loss, token_weight)
        engine.save(SaveLoadMeta(ckpt))
    else:
        engine.load(SaveLoadMeta(ckpt))
    out = {"adapters": lora.gather_full(engine.model, engine.coords)}
    # the distributed optimizer keys its own shards of the parameters: read it by parameter from its buffers
    state = optimizer_state_per_param(engine) if distributed else {id(q): inner.state[q] for q in inner.state}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = lora.gather_full(engine.model, engine.coords, value=lambda q, key=key: state[id(q)][key])
    out["steps"] = sorted({int(inner.state[q]["step"]) for group in inner.param_groups for q in group["params"]})
    return out if p.rank == 0 else {}
