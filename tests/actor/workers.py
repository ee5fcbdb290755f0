"""Functions the multi-process actor tests run on each rank (see ``dist_utils.run_ranks``)."""

from __future__ import annotations

from functools import partial

import torch

from megarl.config.ppo import PPOActorConfig
from megarl.config.train import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from megarl.utils import stats_tracker


def make_batch(lengths: list[int], seed: int = 0, vocab: int = 49152, pad_to: int | None = None) -> dict:
    """A right-padded trajectory batch with random tokens, a prompt of 3 tokens, random rollout data."""
    gen = torch.Generator().manual_seed(seed)
    width = pad_to or max(lengths)
    batch = {
        "input_ids": torch.zeros(len(lengths), width, dtype=torch.int64),
        "attention_mask": torch.zeros(len(lengths), width, dtype=torch.bool),
        "loss_mask": torch.zeros(len(lengths), width, dtype=torch.int32),
        "logprobs": torch.zeros(len(lengths), width),
        "advantages": torch.zeros(len(lengths), width),
    }
    for i, n in enumerate(lengths):
        batch["input_ids"][i, :n] = torch.randint(0, vocab, (n,), generator=gen)
        batch["attention_mask"][i, :n] = True
        batch["loss_mask"][i, 3:n] = 1
        batch["logprobs"][i, :n] = -torch.rand(n, generator=gen) * 3
        batch["advantages"][i, :n] = torch.randn(1, generator=gen)
    batch["rewards"] = torch.randn(len(lengths), generator=gen)
    return batch


def make_grouped_batch(n_groups: int, group: int, prompt_len: int, seed: int = 0, vocab: int = 49152) -> dict:
    """Like :func:`make_batch`, in GRPO groups: ``group`` consecutive rows answer one prompt.

    Answers have 2 to 9 tokens; those of a group's first two rows begin alike, so that rows
    can agree past their prompt.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_groups):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
        opening = torch.randint(0, vocab, (2,), generator=gen)
        for i in range(group):
            answer = torch.randint(0, vocab, (int(torch.randint(2, 10, (1,), generator=gen)),), generator=gen)
            if i < 2:
                answer[:2] = opening
            rows.append(torch.cat([prompt, answer]))
    batch = make_batch([len(r) for r in rows], seed=seed, vocab=vocab)
    for i, r in enumerate(rows):
        batch["input_ids"][i, : len(r)] = r
        batch["loss_mask"][i] = 0
        batch["loss_mask"][i, prompt_len : len(r)] = 1
    return batch


def split_rows(batch: dict, rank: int, size: int) -> dict:
    """Rows ``rank::size`` of every batch tensor (a DP rank's share)."""
    rows = list(range(rank, batch["attention_mask"].shape[0], size))
    return {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def split_groups(batch: dict, rank: int, size: int, group: int) -> dict:
    """Whole groups ``rank::size`` of ``group`` consecutive rows (a group-aligned DP share)."""
    n = batch["attention_mask"].shape[0] // group
    rows = [g * group + i for g in range(rank, n, size) for i in range(group)]
    return {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def engine_config(
    model_dir: str,
    *,
    dtype: str = "float32",
    max_tokens: int = 4096,
    n_mbs: int = 1,
    share_prefix: bool | None = None,
    optimizer: OptimizerConfig | None = None,
    emulate_bf16: bool = False,
    **megatron,
) -> TrainEngineConfig:
    mb_spec = MicroBatchSpec(max_tokens, n_mbs, share_prefix=share_prefix)
    cfg = TrainEngineConfig(
        path=str(model_dir), dtype=dtype, mb_spec=mb_spec, optimizer=optimizer, emulate_bf16=emulate_bf16
    )
    for key, value in megatron.items():
        setattr(cfg.megatron, key, value)
    return cfg


def _engine(model_dir, alloc, **cfg):
    from megarl.actor.engine import MegatronEngine

    engine = MegatronEngine(engine_config(model_dir, **cfg))
    engine.create_process_group(alloc)
    engine.initialize()
    return engine


def logprobs(model_dir: str, alloc: str, batch: dict, temperature: float = 1.0, **cfg) -> torch.Tensor:
    """Next-token logprobs ``[B, S]`` of ``batch`` (every rank holds the whole batch: DP 1)."""
    engine = _engine(model_dir, alloc, **cfg)
    hook = lambda head, mb: head.logprobs(mb["labels"], temperature) * mb["label_mask"]
    return engine.eval().forward(batch, hook)


def shifted_loss_mask(mb: dict) -> torch.Tensor:
    """Positions whose next token is trained on: roll(loss_mask, -1) within each sequence."""
    return torch.roll(mb["loss_mask"], -1, dims=0).bool() & mb["label_mask"]


def ppo_token_loss(head, mb: dict, temperature: float = 1.0) -> torch.Tensor:
    """Token-mean clipped PPO surrogate on the micro-batch (test loss, independent of megarl.actor.losses)."""
    mask = shifted_loss_mask(mb)
    logp = head.logprobs(mb["labels"], temperature)
    old = torch.roll(mb["logprobs"], -1, dims=0)
    adv = torch.roll(mb["advantages"], -1, dims=0)
    ratio = torch.exp(logp - old)
    surr = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return (surr * mask).sum() / mask.sum().clamp(min=1)


def pg_token_loss(head, mb: dict) -> torch.Tensor:
    """Token-mean policy gradient ``-A * logp`` (PPO's surrogate at ratio 1, never clipped)."""
    mask = shifted_loss_mask(mb)
    adv = torch.roll(mb["advantages"], -1, dims=0)
    return -(head.logprobs(mb["labels"]) * adv * mask).sum() / mask.sum().clamp(min=1)


def token_weight(mb: dict) -> torch.Tensor:
    return shifted_loss_mask(mb).sum()


def parity_run(model_dir: str, alloc: str, batch: dict, lr: float = 1e-3, unpacked_too: bool = False, **cfg) -> dict:
    """Everything a parity test compares, from one engine on this rank's DP share of ``batch``.

    Returns ``logp`` (forward before the step, [B_local, S]), ``loss`` (global weighted
    mean of :func:`ppo_token_loss`), ``grads`` (HF name -> fp32 gradient, for the
    tensors this rank's stage / experts hold, gathered over TP), ``logp_after`` (forward
    after one Adam step) and, with ``unpacked_too``, ``logp_unpacked`` (one sequence per
    micro-batch).
    """
    from megarl.actor import cpu_shim
    from megarl.models.hf_io import gather_hf_tensors

    optimizer = OptimizerConfig(
        lr=lr,
        weight_decay=0.0,
        gradient_clipping=0.0,
        use_distributed_optimizer=cfg.pop("distributed_optimizer", False),
    )
    engine = _engine(model_dir, alloc, optimizer=optimizer, **cfg)
    p = engine.parallel
    local = split_rows(batch, p.dp_rank, p.alloc.dp)
    out = {
        "logp": engine.eval().forward(local),
        "packed_tokens": sum(mb.num_tokens for mb in engine.microbatches(local)),
    }
    if unpacked_too:
        engine.config.mb_spec.max_tokens_per_mb = 1
        out["logp_unpacked"] = engine.forward(local)
        engine.config.mb_spec.max_tokens_per_mb = cfg.get("max_tokens", 4096)
    stats = engine.forward_backward(local, ppo_token_loss, token_weight)
    out["loss"] = stats["loss"]
    out["grads"] = gather_hf_tensors(
        engine.model, engine.desc, engine.coords, p.tp_group, p.etp_group, value=lambda param: param.main_grad.float()
    )
    with cpu_shim.device_mode():
        _, out["grad_norm"], _ = engine.optimizer.step()
    out["logp_after"] = engine.eval().forward(local)
    out["dp_rank"] = p.dp_rank
    return out


def logprobs_and_export(model_dir: str, alloc: str, batch: dict, export_dir: str, **cfg) -> torch.Tensor:
    """Next-token logprobs of ``batch`` (DP 1), then an HF export of the loaded weights to ``export_dir``."""
    engine = _engine(model_dir, alloc, **cfg)
    logp = engine.eval().forward(batch)
    engine.export_hf(export_dir)
    return logp


def _ckpt_engine(model_dir, alloc, dtype, checkpoint_layout="data_parallel"):
    from megarl.actor.engine import MegatronEngine

    optimizer = OptimizerConfig(
        lr=1e-3,
        weight_decay=0.01,
        gradient_clipping=1.0,
        lr_scheduler_type="cosine",
        warmup_steps_proportion=0.2,
        use_distributed_optimizer=True,
        checkpoint_layout=checkpoint_layout,
    )
    engine = MegatronEngine(engine_config(model_dir, dtype=dtype, optimizer=optimizer, n_mbs=2))
    engine.create_process_group(alloc)
    engine.initialize(ft_spec=10)
    return engine


def _step(engine, batch) -> float:
    p = engine.parallel
    stats = engine.train_batch(split_rows(batch, p.dp_rank, p.alloc.dp), ppo_token_loss, token_weight)
    engine.step_lr_scheduler()
    return stats["loss"]


def checkpoint_save_then_train(
    model_dir: str,
    alloc: str,
    batches: list,
    ckpt_dir: str,
    dtype: str = "float32",
    checkpoint_layout: str = "data_parallel",
) -> dict:
    """Step on batches[0], step again, save, then step on batches[1] and [2]: the losses a resume must reproduce."""
    from megarl.actor.checkpoint import SaveLoadMeta

    engine = _ckpt_engine(model_dir, alloc, dtype, checkpoint_layout)
    _step(engine, batches[0])
    _step(engine, batches[0])
    engine.set_version(2)
    engine.save(SaveLoadMeta(ckpt_dir))
    state = full_optimizer_state(engine)
    return {"losses": [_step(engine, b) for b in batches[1:]], "lr": engine.current_lr, "state": state}


def checkpoint_load_then_train(
    model_dir: str,
    alloc: str,
    batches: list,
    ckpt_dir: str,
    dtype: str = "float32",
    checkpoint_layout: str = "data_parallel",
) -> dict:
    from megarl.actor.checkpoint import SaveLoadMeta

    engine = _ckpt_engine(model_dir, alloc, dtype, checkpoint_layout)
    engine.load(SaveLoadMeta(ckpt_dir))
    state = full_optimizer_state(engine)
    losses = [_step(engine, b) for b in batches[1:]]
    return {"losses": losses, "lr": engine.current_lr, "version": engine.get_version(), "state": state}


def optimizer_state_per_param(engine) -> dict:
    """The distributed optimizer's main parameter and Adam moments of each of this rank's model parameters,
    ``{id(param): {"param" | "exp_avg" | "exp_avg_sq": tensor shaped like it}}``, read from its live buffers
    (gathered over data parallelism by Megatron)."""
    from megarl.actor import cpu_shim

    per_param = {}
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        with cpu_shim.device_mode():
            world = opt.get_parameter_state_dp_zero(return_on_all_ranks=True)
        for index, buffer in enumerate(opt.buffers):
            (tensors,) = world[index].values()
            for q, (start, end, _) in buffer.param_index_map.items():
                per_param[id(q)] = {key: tensors[key][start:end].view(q.shape) for key in OPTIMIZER_STATE_KEYS}
    return per_param


OPTIMIZER_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def full_optimizer_state(engine, include=None) -> dict:
    """On rank 0, :func:`optimizer_state_per_param` as whole HF-named tensors (``{key: {name: tensor}}``):
    gathered over (expert) tensor parallelism as the HF export gathers weights, over pipeline stages by
    ``gather_object``; ``{}`` on the other ranks. ``include``: which mapping rules (``gather_hf_tensors``'s)."""
    import torch.distributed as dist

    from megarl.models.hf_io import gather_hf_tensors

    per_param = optimizer_state_per_param(engine)
    p = engine.parallel
    local = {
        key: gather_hf_tensors(
            engine.model,
            engine.desc,
            engine.coords,
            p.tp_group,
            p.etp_group,
            value=lambda q, key=key: per_param[id(q)][key],
            **({} if include is None else {"include": include}),
        )
        for key in OPTIMIZER_STATE_KEYS
    }
    parts = [None] * p.world_size if p.rank == 0 else None
    dist.gather_object(local, parts, dst=0)
    if p.rank != 0:
        return {}
    return {key: {n: t for part in parts for n, t in part[key].items()} for key in OPTIMIZER_STATE_KEYS}


def _ppo_actor(model_dir: str, alloc: str, overrides: dict, n_mbs: int = 2, **fields):
    """An initialised fp32 MegatronPPOActor (GRPO groups of 2) with ``fields``, then ``overrides``, set."""
    from megarl.actor.ppo import MegatronPPOActor

    fields.setdefault("optimizer", OptimizerConfig(lr=1e-3, use_distributed_optimizer=False))
    cfg = PPOActorConfig(
        path=str(model_dir), dtype="float32", mb_spec=MicroBatchSpec(4096, n_mbs), group_size=2, **fields
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    actor = MegatronPPOActor(cfg)
    actor.create_process_group(alloc)
    actor.initialize()
    return actor


def _flat(actor, get) -> torch.Tensor:
    """``get(param)`` of every parameter of ``actor``, flattened into one tensor (a copy)."""
    return torch.cat([get(q).flatten().clone() for chunk in actor.model for q in chunk.parameters()])


def ppo_actor_step(model_dir: str, alloc: str, batch: dict, **overrides) -> dict:
    """compute_logp → compute_advantages → ppo_update of MegatronPPOActor on this rank's DP share."""
    actor = _ppo_actor(model_dir, alloc, overrides, ppo_n_minibatches=2)
    p = actor.parallel
    data = split_groups(batch, p.dp_rank, p.alloc.dp, actor.config.group_size)
    data["prox_logp"] = actor.compute_logp(data)
    actor.compute_advantages(data)
    stats = actor.ppo_update(data)
    return {"stats": stats, "data": data, "logp_after": actor.compute_logp(data), "dp_rank": p.dp_rank}


def advantages_on_shares(model_dir: str, alloc: str, batch: dict, settings: list[dict]) -> dict:
    """compute_advantages of MegatronPPOActor under each of ``settings`` (config fields) on this rank's DP
    share, cut to its own longest row as the rollout side hands it over; and Dr. GRPO's batch width."""
    actor = _ppo_actor(model_dir, alloc, {})
    p = actor.parallel
    share = split_groups(batch, p.dp_rank, p.alloc.dp, actor.config.group_size)
    width = int(share["attention_mask"].sum(1).max())
    share = {k: v[:, :width] if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in share.items()}
    share["prox_logp"] = share["logprobs"].clone()
    advantages = []
    for fields in settings:
        for key, value in fields.items():
            setattr(actor.config, key, value)
        data = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in share.items()}
        if actor.config.adv_estimator != "gae":
            del data["values"]  # a critic's, for GAE only
        actor.compute_advantages(data)
        advantages.append(data["advantages"])
    return {"advantages": advantages, "dp_rank": p.dp_rank, "batch_width": actor._batch_width(share)}


def prox_paths(model_dir: str, batch: dict, **overrides) -> dict:
    """Loss and gradients of one PPO update with the proximal logprobs from a pass of their own vs
    from the update's forward (``needs_prox_pass`` False): same weights, same batch."""
    from megarl.actor.ppo import ppo_loss, ppo_loss_weight

    actor = _ppo_actor(model_dir, "d1p1t1", overrides, ppo_n_minibatches=1)
    cfg = actor.config
    loss_fn = partial(ppo_loss, cfg=cfg, norm_len=batch["attention_mask"].shape[1])
    weight_fn = partial(ppo_loss_weight, mode=cfg.loss_agg_mode)
    out = {"needs_prox_pass": actor.needs_prox_pass()}
    for name, separate in (("separate", True), ("from_update", False)):
        data = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if separate:
            data["prox_logp"] = actor.compute_logp(data)
        actor.compute_advantages(data)
        with stats_tracker.scope(name):
            stats = actor.forward_backward(data, loss_fn, weight_fn)
        grads = _flat(actor, lambda q: q.main_grad)
        out[name] = {"loss": stats["loss"], "grads": grads, "stats": stats_tracker.export()}
    return out


def inert_row_paths(model_dir: str, alloc: str, batch: dict, **overrides) -> dict:
    """One GRPO mini-batch's loss and gradients with every row vs without the rows of zero advantage
    (``drop_inert_rows``), then a ``train_minibatch`` step: the parameters before and after."""
    from megarl.actor.ppo import ppo_loss, ppo_loss_weight

    optimizer = OptimizerConfig(lr=1e-3, weight_decay=0.01, use_distributed_optimizer=False)
    actor = _ppo_actor(model_dir, alloc, overrides, n_mbs=1, optimizer=optimizer)
    cfg, p = actor.config, actor.parallel
    data = split_groups(batch, p.dp_rank, p.alloc.dp, cfg.group_size)
    actor.compute_advantages(data)
    loss_fn = partial(ppo_loss, cfg=cfg, norm_len=batch["attention_mask"].shape[1])
    weight_fn = partial(ppo_loss_weight, mode=cfg.loss_agg_mode)

    out = {"full": actor.forward_backward(data, loss_fn, weight_fn)}
    out["full"]["grads"] = _flat(actor, lambda q: q.main_grad)
    active, inert_weight, n_inert = actor.drop_inert_rows(data, weight_fn)
    out["skip"] = actor.forward_backward(active, loss_fn, weight_fn, inert_weight)
    n_active = 0 if active is None else len(active["rewards"])
    out["skip"].update(grads=_flat(actor, lambda q: q.main_grad), n_inert=n_inert, n_active=n_active)
    out["params_before"] = _flat(actor, lambda q: q.detach())
    out["step"] = actor.train_minibatch(data, loss_fn, weight_fn)
    out["params_after"] = _flat(actor, lambda q: q.detach())
    return out


# ---------------------------------------------------------------------------------------
# Critic (megarl.actor.critic)
# ---------------------------------------------------------------------------------------


def make_critic_batch(lengths: list[int], seed: int = 0, batch: dict | None = None) -> dict:
    """A batch as the critic sees it after ``compute_advantages``: next-token ``loss_mask``,
    the rollout's ``values`` and the GAE ``returns`` (random, so that value clipping bites).
    ``batch``: start from this one (e.g. :func:`make_grouped_batch`) instead of random rows."""
    batch = make_batch(lengths, seed=seed) if batch is None else batch
    gen = torch.Generator().manual_seed(seed + 1)
    batch["loss_mask"] = (torch.roll(batch["loss_mask"], -1, dims=-1).bool() & batch["attention_mask"]).to(torch.int32)
    shape = batch["input_ids"].shape
    batch["values"] = torch.randn(shape, generator=gen) * 0.3 * batch["loss_mask"]
    batch["returns"] = torch.randn(shape, generator=gen) * batch["loss_mask"]
    return batch


def _critic(model_dir: str, alloc: str, lr: float = 1e-5, n_mbs: int = 2, share_prefix: bool | None = None, **fields):
    from megarl.actor.critic import MegatronCritic
    from megarl.config.ppo import PPOCriticConfig

    optimizer = OptimizerConfig(lr=lr, weight_decay=0.0, gradient_clipping=0.0, use_distributed_optimizer=False)
    critic = MegatronCritic(
        PPOCriticConfig(
            path=str(model_dir),
            dtype="float32",
            mb_spec=MicroBatchSpec(4096, n_mbs, share_prefix),
            optimizer=optimizer,
            **fields,
        )
    )
    critic.create_process_group(alloc)
    critic.initialize(ft_spec=10)
    return critic


def critic_run(model_dir: str, alloc: str, batch: dict, eps_clip: float | None = 0.2, **cfg) -> dict:
    """A critic's values, value loss and gradients on this rank's DP share of ``batch``, then one
    ``ppo_update`` (Adam) and the values after it."""
    from megarl.actor.critic import critic_loss
    from megarl.actor.ppo import ppo_loss_weight
    from megarl.models.hf_io import gather_hf_tensors

    critic = _critic(model_dir, alloc, eps_clip=eps_clip, **cfg)
    p = critic.parallel
    local = split_rows(batch, p.dp_rank, p.alloc.dp)
    out = {"values": critic.compute_values(local), "dp_rank": p.dp_rank}
    out["packed_tokens"] = sum(mb.num_tokens for mb in critic.microbatches(local))
    stats = critic.forward_backward(
        local, partial(critic_loss, eps_clip=eps_clip), partial(ppo_loss_weight, mode="token-mean")
    )
    out["loss"] = stats["loss"]
    out["grads"] = gather_hf_tensors(
        critic.model,
        critic.desc,
        critic.coords,
        p.tp_group,
        p.etp_group,
        value=lambda param: param.main_grad.float(),
        include=lambda rule: rule.megatron != "output_layer.weight",
    )
    out["update"] = critic.ppo_update(local)
    out["values_after"] = critic.compute_values(local)
    return out


def critic_save_then_train(model_dir: str, alloc: str, batch: dict, ckpt_dir: str, export_dir: str) -> dict:
    """One update, a checkpoint (and an HF export), then a second update: what a resume must reproduce."""
    from megarl.actor.checkpoint import SaveLoadMeta

    critic = _critic(model_dir, alloc)
    local = split_rows(batch, critic.parallel.dp_rank, critic.parallel.alloc.dp)
    critic.ppo_update(local)
    critic.set_version(1)
    critic.save(SaveLoadMeta(ckpt_dir))
    critic.export_hf(export_dir)
    values = critic.compute_values(local)
    return {
        "values": values,
        "second": critic.ppo_update(local),
        "values_after": critic.compute_values(local),
        "dp_rank": critic.parallel.dp_rank,
    }


def critic_load_then_train(model_dir: str, alloc: str, batch: dict, ckpt_dir: str) -> dict:
    from megarl.actor.checkpoint import SaveLoadMeta

    critic = _critic(model_dir, alloc)
    critic.load(SaveLoadMeta(ckpt_dir))
    local = split_rows(batch, critic.parallel.dp_rank, critic.parallel.alloc.dp)
    values = critic.compute_values(local)
    return {
        "values": values,
        "second": critic.ppo_update(local),
        "values_after": critic.compute_values(local),
        "version": critic.get_version(),
    }


def gap_step(model_dir: str, alloc: str, batch: dict, offsets: torch.Tensor) -> dict:
    """One PPO step whose behaviour logprobs are the trainer's own plus ``offsets`` (per token, on the
    loss tokens): the train–inference gap the step reports should be exactly ``|offsets|``.

    Rows alternate version lag 0 / 1 and servers 0 / 1 (``server_index``); DP ranks take rows ``rank::dp``.
    """
    actor = _ppo_actor(model_dir, alloc, {}, ppo_n_minibatches=1)
    p = actor.parallel
    rows = list(range(p.dp_rank, batch["attention_mask"].shape[0], p.alloc.dp))
    data = {k: v[rows].clone() for k, v in batch.items()}
    mask = data["loss_mask"].bool()
    actor.set_version(3)
    trainer = torch.roll(actor.compute_logp(data), shifts=1, dims=-1)  # token-aligned, like a server's
    data["logprobs"] = torch.where(mask, trainer + offsets[rows], torch.zeros_like(trainer))
    lag = torch.tensor([r % 2 for r in rows])
    data["versions"] = torch.where(mask, (3 - lag)[:, None], -1).to(torch.int32)
    data["server_index"] = torch.tensor([(r // 2) % 2 for r in rows], dtype=torch.int32)
    actor.compute_advantages(data)
    stats = actor.ppo_update(data)
    return {k: v for step in stats for k, v in step.items() if "/gap/" in k or "capped_ratio" in k}


def heartbeat_steps(model_dir: str, alloc: str, batch: dict, run_dir: str) -> dict:
    """One PPO update under a heartbeat that traces collectives: the steps it was told (micro-batches)
    and the collectives it saw."""
    import os

    from megarl.utils import heartbeat

    steps, ops = [], []
    original = torch.distributed.all_reduce
    beat = heartbeat.start(run_dir, f"trainer-{os.environ['RANK']}", 0.1, trace_collectives=True)
    wrapped = torch.distributed.all_reduce is not original
    told, entered = beat.step, beat.collectives._enter
    beat.step = lambda text: (steps.append(text), told(text))
    beat.collectives._enter = lambda op, group: (ops.append(op), entered(op, group))
    actor = _ppo_actor(model_dir, alloc, {})
    p = actor.parallel
    data = split_groups(batch, p.dp_rank, p.alloc.dp, actor.config.group_size)
    data["prox_logp"] = actor.compute_logp(data)
    actor.compute_advantages(data)
    with heartbeat.phase("train_step"):
        actor.ppo_update(data)
    heartbeat.stop()
    return {"steps": steps, "ops": ops, "wrapped": wrapped, "restored": torch.distributed.all_reduce is original}


def routing_step(model_dir: str, alloc: str, batch: dict) -> dict:
    """One PPO update of a MoE actor on a batch carrying the servers' ``routed_experts``: the routing stats."""
    actor = _ppo_actor(model_dir, alloc, {})
    p = actor.parallel
    data = split_groups(batch, p.dp_rank, p.alloc.dp, actor.config.group_size)
    data["prox_logp"] = actor.compute_logp(data)
    actor.compute_advantages(data)
    stats = actor.ppo_update(data)[0]
    return {k: v for k, v in stats.items() if "routing" in k}


def bf16_update_run(
    model_dir: str, alloc: str, batch: dict, roundings: list[str], distributed: bool, steps: int = 3
) -> dict:
    """For each bf16 rounding, a fresh engine (the same initial weights) and ``steps`` Adam steps (lr 1e-5):
    how far its bf16 weights moved (mean absolute change), the summed absolute change of this rank's
    fp32 main parameters, and the bf16 weights; keyed by rounding."""
    from megarl.actor.optim import main_params_of_low_precision

    results = {}
    for rounding in roundings:
        optimizer = OptimizerConfig(
            lr=1e-5,
            weight_decay=0.0,
            gradient_clipping=0.0,
            use_distributed_optimizer=distributed,
            bf16_rounding=rounding,
        )
        engine = _engine(model_dir, alloc, dtype="bfloat16", optimizer=optimizer)
        p = engine.parallel
        local = split_rows(batch, p.dp_rank, p.alloc.dp)
        weights = lambda: torch.cat(
            [q.detach().float().flatten() for chunk in engine.model for q in chunk.parameters()]
        )
        mains = lambda: torch.cat(
            [m.detach().flatten().clone() for m in main_params_of_low_precision(engine.optimizer)]
        )
        w0, m0 = weights(), mains()
        for _ in range(steps):
            engine.train_batch(local, pg_token_loss, token_weight)
        w, m = weights(), mains()
        engine.destroy()
        # a distributed optimizer holds this rank's shard of the main parameters: the test adds them up
        results[rounding] = {
            "weights_moved": float((w - w0).abs().mean()),
            "mains_abs_change": float((m - m0).abs().sum()),
            "mains_numel": m.numel(),
            "weights": w,
            "dp_rank": p.dp_rank,
        }
    return results


def bf16_logp_and_grads(model_dir: str, alloc: str, batch: dict, dtype: str, emulate: bool = False) -> dict:
    """Next-token logprobs of ``batch`` and the main gradients of :func:`pg_token_loss` (fp32 copies)."""
    optimizer = OptimizerConfig(lr=1e-5, use_distributed_optimizer=False)
    engine = _engine(model_dir, alloc, dtype=dtype, emulate_bf16=emulate, optimizer=optimizer)
    logp = engine.eval().forward(batch)
    engine.forward_backward(batch, pg_token_loss, token_weight)
    grads = torch.cat([q.main_grad.float().flatten() for chunk in engine.model for q in chunk.parameters()])
    return {"logp": logp.float(), "grads": grads}


def bf16_main_params_through_checkpoint(model_dir: str, alloc: str, runs: list[tuple[str, bool, str]]) -> list[dict]:
    """For each ``(ckpt_dir, save, rounding)``, in order, a fresh bf16 engine's fp32 main parameters and
    bf16 weights: after one step, saved to ``ckpt_dir`` (``save``), or after loading ``ckpt_dir`` into an
    engine built with another dither seed."""
    return [_bf16_main_params(model_dir, alloc, *run) for run in runs]


def _bf16_main_params(model_dir: str, alloc: str, ckpt_dir: str, save: bool, rounding: str) -> dict:
    from megarl.actor import optim
    from megarl.actor.checkpoint import SaveLoadMeta
    from megarl.actor.optim import main_params_of_low_precision

    dither = optim.dither_main_params
    if not save:  # a different dither at build time, which the load must replace
        optim.dither_main_params = lambda optimizer, dtype, seed=0: dither(optimizer, dtype, seed=seed + 1)
    try:
        optimizer = OptimizerConfig(lr=1e-5, use_distributed_optimizer=True, bf16_rounding=rounding)
        engine = _engine(model_dir, alloc, dtype="bfloat16", optimizer=optimizer)
    finally:
        optim.dither_main_params = dither
    if save:  # Megatron saves the optimizer once it has stepped
        engine.train_batch(make_batch([12, 9]), pg_token_loss, token_weight)
        engine.save(SaveLoadMeta(ckpt_dir))
    else:
        engine.load(SaveLoadMeta(ckpt_dir))
    mains = torch.cat([m.detach().flatten().clone() for m in main_params_of_low_precision(engine.optimizer)])
    weights = torch.cat([q.detach().float().flatten() for chunk in engine.model for q in chunk.parameters()])
    engine.destroy()
    return {"mains": mains, "weights": weights}


def train_clock_parts(model_dir: str, alloc: str, batch: dict) -> dict:
    """One train step's parts from the engine's clock (after a warm-up step), and the step's wall time."""
    import time

    engine = _ckpt_engine(model_dir, alloc, "float32")
    _step(engine, batch)
    engine.train_clock.reset()
    start = time.perf_counter()
    _step(engine, batch)
    return {"parts": dict(engine.train_clock.seconds), "wall": time.perf_counter() - start}


def teacher_in_trainer(model_dir: str, alloc: str, batch: dict, top_k: int) -> tuple[dict, dict]:
    """On-policy distillation's teacher in the trainer (``teacher.path``) as the run builds it, scoring ``batch``:
    the sampled tokens only, then with the top ``top_k`` too."""
    from transformers import AutoTokenizer

    from megarl.config import GRPOConfig
    from megarl.config.rollout import TeacherConfig
    from megarl.run.components import build_teacher_model, teacher_scores

    config = GRPOConfig(teacher=TeacherConfig(path=model_dir))
    config.actor.path, config.actor.dtype = model_dir, "float32"
    actor = _engine(model_dir, alloc)  # the process groups the run's actor makes
    teacher = build_teacher_model(config, actor.parallel, AutoTokenizer.from_pretrained(model_dir))
    return teacher_scores(teacher, batch), teacher_scores(teacher, batch, top_k)
