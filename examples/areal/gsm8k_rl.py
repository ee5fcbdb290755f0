"""AReaL's GSM8K GRPO walkthrough with megarl's imports: the walkthrough's actor, rollout engine and
training loop, its calls as they are. ``megarl run`` starts the servers, then this script under
``torchrun`` with ``--config`` (the run's resolved config) and the servers' addresses and the run's
API key in its environment::

    megarl run configs/gsm8k_grpo_cpu.yaml launcher.trainer_entry=examples/areal/gsm8k_rl.py

Data parallel only (``megatron:dN``): every rank asks the servers for its share of the batch.
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from transformers import AutoTokenizer

from megarl.api.io_struct import FinetuneSpec
from megarl.config import AllocationMode, GRPOConfig
from megarl.data import create_dataloader, load_rl_dataset
from megarl.models import resolve_model_path
from megarl.reward.gsm8k import gsm8k_reward_fn
from megarl.rollout import RemoteVLLMEngine
from megarl.run.actor import PPOActor
from megarl.run.prelaunch import load_expr_config
from megarl.run.weight_sync import WeightUpdateMeta
from megarl.workflow.rlvr import RLVRWorkflow


def get_gsm8k_dataset(config: GRPOConfig, split: str, tokenizer, rank: int, world_size: int):
    """This rank's share of ``split`` as chat rows (the copy bundled with megarl for path ``gsm8k``)."""
    data = config.train_dataset
    return load_rl_dataset(
        data.path,
        split,
        rank=rank,
        world_size=world_size,
        type=data.type,
        max_prompt_tokens=data.max_prompt_tokens,
        tokenizer=tokenizer,
    )


def main(args: list[str]) -> None:
    config, _ = load_expr_config(args, GRPOConfig)
    actor = PPOActor(config=config.actor)
    actor.create_process_group(parallel_strategy=config.allocation_mode)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.tokenizer_path or config.actor.path))
    dataset = get_gsm8k_dataset(config, config.train_dataset.split, tokenizer, rank, world_size)
    train_dataloader = create_dataloader(
        dataset,
        batch_size=config.train_dataset.batch_size // world_size,
        shuffle=config.train_dataset.shuffle,
        seed=config.seed,
    )
    ft_spec = FinetuneSpec(
        total_train_epochs=config.total_train_epochs,
        dataset_size=len(dataset) * world_size,
        train_batch_size=config.train_dataset.batch_size,
    )
    max_steps = len(train_dataloader) * config.total_train_epochs
    if config.total_train_steps is not None:
        max_steps = min(max_steps, config.total_train_steps)
    actor.initialize(None, ft_spec)

    rollout = RemoteVLLMEngine(config.rollout)  # the servers: $MEGARL_LLM_SERVER_ADDRS, set by megarl run
    rollout.initialize(
        batch_size=config.train_dataset.batch_size // world_size,
        tokenizer=tokenizer,
        vocab_size=actor.desc.dims.vocab_size,
    )
    weight_update_meta = WeightUpdateMeta.from_megatron_xccl(
        AllocationMode.from_str(config.allocation_mode), config.weight_update
    )
    actor.connect_engine(rollout, weight_update_meta)
    workflow = RLVRWorkflow(
        reward_fn=gsm8k_reward_fn,
        gconfig=config.gconfig,
        tokenizer=tokenizer,
        enable_thinking=False,
    )

    try:
        for global_step in range(max_steps):
            # ==== Rollout Phase ====
            batch = actor.prepare_batch(
                train_dataloader,
                granularity=actor.config.group_size,
                workflow=workflow,
                should_accept_fn=lambda sample: True,
            )
            # ==== Training Phase ====
            if config.actor.recompute_logprob:
                logp = actor.compute_logp(batch)
                batch["prox_logp"] = logp
            actor.compute_advantages(batch)
            stats = actor.ppo_update(batch)
            actor.step_lr_scheduler()
            # ==== Weight Synchronization Phase ====
            rollout.pause()
            actor.update_weights(weight_update_meta)
            actor.set_version(global_step + 1)
            rollout.set_version(global_step + 1)
            rollout.resume()
            if rank == 0:
                loss = stats[-1].get("ppo_actor/loss", float("nan"))
                rows = len(batch["input_ids"])
                print(f"step {global_step + 1}/{max_steps}: {rows} rows, loss {loss:.4f}", flush=True)
    finally:
        workflow.close()
        rollout.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
