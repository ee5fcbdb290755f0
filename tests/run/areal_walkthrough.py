"""AReaL's GSM8K walkthrough as a user ports it to megarl: its training loop, its own calls on the actor
and the rollout engine, with megarl's names at their public paths (docs/name-mapping.md). Runs on one
trainer rank (``tests.actor.dist_utils.run_ranks``) against a real vLLM server."""

from __future__ import annotations


def reward_fn(prompt, completions, prompt_ids, completion_ids, **row) -> float:
    """Any reward of AReaL's signature: here, whether the completion has an even number of tokens."""
    return float(len(completion_ids) % 2 == 0)


def walkthrough(model_dir: str, address: str, steps: int = 2) -> dict:
    import torch
    from transformers import AutoTokenizer

    from megarl.api.io_struct import FinetuneSpec, GenerationHyperparameters
    from megarl.config import AllocationMode
    from megarl.config.bridge import WeightUpdateConfig
    from megarl.config.ppo import PPOActorConfig
    from megarl.config.rollout import InferenceEngineConfig
    from megarl.config.train import MicroBatchSpec, OptimizerConfig
    from megarl.data import create_dataloader, load_rl_dataset
    from megarl.rollout import RemoteVLLMEngine
    from megarl.run.actor import PPOActor
    from megarl.run.weight_sync import WeightUpdateMeta
    from megarl.workflow.rlvr import RLVRWorkflow

    allocation_mode = "vllm:d1t1+megatron:d1p1t1"
    batch_size, n_samples = 2, 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = load_rl_dataset("arithmetic", "train", type="chat")
    dataloader = create_dataloader(dataset, batch_size=batch_size, shuffle=True, seed=1, drop_last=True)
    ft_spec = FinetuneSpec(total_train_epochs=1, dataset_size=len(dataset), train_batch_size=batch_size)

    config = PPOActorConfig(
        path=model_dir,
        dtype="auto",  # as the server's: the probe compares like with like
        mb_spec=MicroBatchSpec(max_tokens_per_mb=4096),
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0, lr_scheduler_type="constant"),
        group_size=n_samples,
    )
    actor = PPOActor(config=config)
    actor.create_process_group(parallel_strategy=allocation_mode)
    actor.initialize(None, ft_spec)

    rollout = RemoteVLLMEngine(InferenceEngineConfig(max_concurrent_rollouts=4, max_staleness=0, request_timeout=120))
    rollout.initialize(
        server_addrs=[address], batch_size=batch_size, tokenizer=tokenizer, vocab_size=actor.desc.dims.vocab_size
    )
    weight_update_meta = WeightUpdateMeta.from_megatron_xccl(
        AllocationMode.from_str(allocation_mode), WeightUpdateConfig(probe_sequences=2, probe_tokens=16, probe_every=1)
    )
    actor.connect_engine(rollout, weight_update_meta)
    workflow = RLVRWorkflow(
        reward_fn=reward_fn,
        gconfig=GenerationHyperparameters(n_samples=n_samples, max_new_tokens=8),
        tokenizer=tokenizer,
        enable_thinking=False,
        reward_max_workers=1,
    )
    out: dict = {"steps": []}
    try:
        for global_step in range(steps):
            # ==== Rollout Phase ====
            batch = actor.prepare_batch(
                dataloader, granularity=actor.config.group_size, workflow=workflow, should_accept_fn=lambda s: True
            )
            generated = batch["versions"][batch["loss_mask"].bool()]
            # ==== Training Phase ====
            if config.recompute_logprob:
                logp = actor.compute_logp(batch)
                batch["prox_logp"] = logp
            actor.compute_advantages(batch)
            ppo_stats = actor.ppo_update(batch)
            actor.step_lr_scheduler()
            # ==== Weight Synchronization Phase ====
            rollout.pause()
            sync = actor.update_weights(weight_update_meta)
            actor.set_version(global_step + 1)
            rollout.set_version(global_step + 1)
            rollout.resume()
            out["steps"].append(
                {
                    "rows": int(batch["input_ids"].shape[0]),
                    "versions": sorted(set(generated.tolist())),
                    "loss": [s["ppo_actor/loss"] for s in ppo_stats if "ppo_actor/loss" in s],
                    "probe_max": sync.get("logprob_diff_max"),
                    "logp_finite": bool(torch.isfinite(logp).all()),
                }
            )
        out["actor_version"] = actor.get_version()
        out["rollout_version"] = rollout.get_version()
    finally:
        workflow.close()
        rollout.destroy()
    return out
