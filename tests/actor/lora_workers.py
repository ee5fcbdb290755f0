"""Functions the LoRA tests run on each rank (see ``dist_utils.run_ranks``), and the adapters they load."""

from __future__ import annotations

import zlib
from functools import partial

import torch

from megarl.config.train import LoRAConfig, OptimizerConfig
from tests.actor.workers import engine_config, ppo_token_loss, split_rows, token_weight

RANK, ALPHA = 4, 8.0
DENSE = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]

# Deliberately wrong ways to split the full adapter matrices over TP ranks (same local shapes, so the
# model runs): what a swapped split of A or B computes. The parity test must tell each from the right one.
WRONG_SPLITS = {
    # A of a column-parallel layer split over its input dim (as a row-parallel layer's A) instead of replicated
    "column A split": lambda full, split, which, r, n: (
        _own_part(full, 1, r, n) if split == "replicated" and which == "lora_a" else None
    ),
    # B of a row-parallel layer split over its output dim (as a column-parallel layer's B) instead of replicated
    "row B split": lambda full, split, which, r, n: (
        _own_part(full, 0, r, n) if split == "replicated" and which == "lora_b" else None
    ),
    # B of linear_fc1 split as one block of rows instead of each rank's gate rows and up rows
    "fc1 B as one block": lambda full, split, which, r, n: full.chunk(n, 0)[r] if split == "gate_up" else None,
}


def _own_part(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """``full`` with everything but rank ``rank``'s ``1/size`` along ``dim`` zeroed (same shape)."""
    out = torch.zeros_like(full)
    step = full.shape[dim] // size
    index = [slice(None)] * full.dim()
    index[dim] = slice(rank * step, (rank + 1) * step)
    out[tuple(index)] = full[tuple(index)]
    return out


def nonzero_adapter(name: str, shape: tuple[int, int]) -> torch.Tensor:
    """A full adapter matrix for ``name`` with B nonzero, so that the adapter changes the outputs."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    full = torch.randn(shape, generator=gen)
    return full / shape[1] ** 0.5 if name.endswith("lora_a") else 0.05 * full


def random_peft_adapter(
    model_dir, out, targets: list[str], rank: int, alpha: float, b_scale: float = 0.05, use_rslora: bool = False
):
    """A PEFT adapter made by HF ``peft`` on the HF model at ``model_dir``, as one trained with PEFT or TRL:
    each of ``targets`` (HF module names) its own random ``lora_A`` and ``lora_B`` (``b_scale`` x N(0, 1)),
    saved by ``save_pretrained`` to ``out``; returns ``out``. ``use_rslora``: rank-stabilised scaling."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, use_rslora=use_rslora)
    model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                scale = param.shape[1] ** -0.5 if ".lora_A." in name else b_scale
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(out)
    return out


def _lora_engine(
    model_dir: str,
    alloc: str,
    lora: LoRAConfig,
    n_mbs: int,
    distributed: bool,
    recompute: bool,
    layout: str = "any",  # the checkpoint tests load at another TP size
    **megatron,
):
    from megarl.actor.engine import MegatronEngine

    optimizer = OptimizerConfig(
        lr=1e-3,
        weight_decay=0.0,
        gradient_clipping=0.0,
        use_distributed_optimizer=distributed,
        checkpoint_layout=layout,
    )
    cfg = engine_config(model_dir, optimizer=optimizer, n_mbs=n_mbs, **megatron)
    cfg.lora = lora
    cfg.gradient_checkpointing = recompute
    engine = MegatronEngine(cfg)
    engine.create_process_group(alloc)
    engine.initialize()
    return engine


def _trainable_footprint(engine) -> dict:
    """Parameters the optimizer holds and bytes of the DDP gradient buffers, on this rank."""
    buffers = [buf for chunk in engine.model for buf in chunk.buffers + chunk.expert_parallel_buffers]
    return {
        "optimizer_params": sum(q.numel() for group in engine.optimizer.param_groups for q in group["params"]),
        "grad_buffer_bytes": sum(buf.grad_data.numel() * buf.grad_data.element_size() for buf in buffers),
    }


def lora_run(
    model_dir: str,
    alloc: str,
    batch: dict,
    targets: list[str] = DENSE,
    sequence_parallel: bool = True,
    n_mbs: int = 2,
    wrong_splits: bool = False,
    measure_full: bool = False,
    distributed_optimizer: bool = False,
    recompute: bool = False,
    peft_dir: str | None = None,
    init_from: str | None = None,
    peft_dir_after: str | None = None,
    use_rslora: bool = False,
) -> dict:
    """On this rank's DP share of ``batch``, with :func:`nonzero_adapter`'s adapters: logprobs, PPO loss and the
    full adapter gradients, the frozen base's state, one Adam step (logprobs after, base unchanged), and
    the optimizer / grad-buffer footprint (``measure_full``: also of the same engine without LoRA). The
    adapters are exported as PEFT directories to ``peft_dir`` before the step and ``peft_dir_after`` after."""
    from megarl.actor import cpu_shim
    from megarl.models import lora

    settings = LoRAConfig(rank=RANK, alpha=ALPHA, use_rslora=use_rslora, target_modules=targets, init_from=init_from)
    engine = _lora_engine(
        model_dir, alloc, settings, n_mbs, distributed_optimizer, recompute, sequence_parallel=sequence_parallel
    )
    p = engine.parallel
    local = split_rows(batch, p.dp_rank, p.alloc.dp)
    if init_from is None:  # else the engine started from that PEFT directory
        lora.load_full(engine.model, engine.coords, nonzero_adapter)
    if peft_dir is not None:
        engine.export_adapters(peft_dir)
    adapters = {id(item.param) for item in lora.adapter_params(engine.model, engine.coords)}
    base = [q for chunk in engine.model for q in chunk.parameters() if id(q) not in adapters]
    out = {"dp_rank": p.dp_rank, "logp": engine.eval().forward(local), **_trainable_footprint(engine)}
    out["n_adapter_params"] = sum(q.numel() for chunk in engine.model for q in chunk.parameters() if id(q) in adapters)
    out["base_frozen"] = all(not q.requires_grad and getattr(q, "main_grad", None) is None for q in base)
    out["loss"] = engine.forward_backward(local, ppo_token_loss, token_weight)["loss"]
    out["grads"] = lora.gather_full(engine.model, engine.coords, value=lambda q: q.main_grad.float())
    base_before = torch.cat([q.detach().flatten().clone() for q in base])
    with cpu_shim.device_mode():
        _, out["grad_norm"], _ = engine.optimizer.step()
    out["base_unchanged"] = torch.equal(base_before, torch.cat([q.detach().flatten() for q in base]))
    out["adapters_after"] = lora.gather_full(engine.model, engine.coords)
    out["logp_after"] = engine.eval().forward(local)
    if peft_dir_after is not None:
        engine.export_adapters(peft_dir_after)
    if wrong_splits:
        out["wrong"] = {what: _logp_with_split(engine, local, split) for what, split in WRONG_SPLITS.items()}
    if measure_full:
        out["full_model"] = _full_model_footprint(engine)
    return out


@torch.no_grad()
def _logp_with_split(engine, local: dict, wrong) -> torch.Tensor:
    """Logprobs with :func:`nonzero_adapter`'s matrices split by ``wrong`` where it says so (else rightly)."""
    from megarl.models import lora

    for item in lora.adapter_params(engine.model, engine.coords):
        full = nonzero_adapter(item.name, lora.full_shape(item))
        which = item.name.rsplit(".", 1)[-1]
        part = wrong(full, item.split, which, item.rank, item.size)
        item.param.copy_(lora.shard(full, item.split, item.rank, item.size) if part is None else part)
    return engine.eval().forward(local)


def _full_model_footprint(lora_engine) -> dict:
    """The same model and optimizer without LoRA, on the LoRA engine's process groups."""
    from megarl.actor.engine import MegatronEngine

    cfg = lora_engine.config
    cfg.lora = LoRAConfig()
    engine = MegatronEngine(cfg)
    engine.initialize(parallel=lora_engine.parallel)
    return _trainable_footprint(engine)


def lora_reference_run(
    model_dir: str, alloc: str, batch: dict, targets: list[str] = DENSE, init_from=None, overlap: bool = False
) -> dict:
    """A LoRA actor's KL reference scored by its own model (``AdapterReference``): its logprobs before and after
    an Adam step, the actor's own after the step, and whether the actor's adapters kept their bits.
    ``overlap``: the distributed optimizer with its overlapped reduce-scatter and all-gather."""
    from megarl.actor.engine import MegatronEngine
    from megarl.actor.reference import AdapterReference
    from megarl.models import lora

    settings = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets, init_from=init_from)
    overlapped = {"overlap_grad_reduce": overlap, "overlap_param_gather": overlap}
    engine = _lora_engine(model_dir, alloc, settings, 2, overlap, False, sequence_parallel=True, **overlapped)
    p = engine.parallel
    local = split_rows(batch, p.dp_rank, p.alloc.dp)
    reference = AdapterReference(engine)
    out = {"dp_rank": p.dp_rank, "ref_before": reference.compute_logp(local)}
    engine.train_batch(local, ppo_token_loss, token_weight)
    trained = [item.param.detach().clone() for item in lora.adapter_params(engine.model, engine.coords)]
    out["ref_after"] = reference.compute_logp(local)
    kept = [item.param.detach() for item in lora.adapter_params(engine.model, engine.coords)]
    out["adapters_kept"] = all(torch.equal(a, b) for a, b in zip(trained, kept))
    out["logp"] = MegatronEngine.compute_logp(engine, local)
    return out


def critic_lora_run(model_dir: str, alloc: str, batch: dict, init_from: str, targets: list[str]) -> dict:
    """A LoRA critic started from the PEFT adapter ``init_from``: values, value loss, the gradients of its
    adapters and value head (full, by canonical and HF name), one ``ppo_update``, the values after it, and
    whether the base stayed and the head moved."""
    from megarl.actor.critic import critic_loss
    from megarl.actor.ppo import ppo_loss_weight
    from megarl.models import lora
    from megarl.models.hf_io import unwrap
    from tests.actor.workers import _critic

    settings = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets, init_from=init_from)
    critic = _critic(model_dir, alloc, lr=1e-3, lora=settings)
    p = critic.parallel
    local = split_rows(batch, p.dp_rank, p.alloc.dp)
    out = {"dp_rank": p.dp_rank, "values": critic.compute_values(local)}
    weight = partial(ppo_loss_weight, mode="token-mean")
    out["loss"] = critic.forward_backward(local, partial(critic_loss, eps_clip=0.2), weight)["loss"]
    out["grads"] = lora.gather_full(critic.model, critic.coords, value=lambda q: q.main_grad.float())
    heads = [unwrap(chunk).value_head for chunk in critic.model if unwrap(chunk).post_process]
    for head in heads:
        out["grads"].update({f"score.{n}": q.main_grad.float().clone() for n, q in head.named_parameters()})
    adapters = {id(item.param) for item in lora.adapter_params(critic.model, critic.coords)}
    trained = adapters | {id(q) for head in heads for q in head.parameters()}
    base = [q for chunk in critic.model for q in chunk.parameters() if id(q) not in trained]
    base_before = [q.detach().clone() for q in base]
    head_before = [q.detach().clone() for head in heads for q in head.parameters()]
    critic.ppo_update(local)
    out["values_after"] = critic.compute_values(local)
    out["base_frozen"] = all(not q.requires_grad for q in base)
    out["base_unchanged"] = all(torch.equal(a, q.detach()) for a, q in zip(base_before, base))
    head_after = [q.detach() for head in heads for q in head.parameters()]
    out["head_moved"] = bool(heads) and any(not torch.equal(a, b) for a, b in zip(head_before, head_after))
    return out
