"""The trainer side: a Megatron-Core engine and the PPO / GRPO actor built on it.

Modules (imported explicitly; nothing heavy is imported with the package):

- ``parallel``: torch.distributed + Megatron process groups from the allocation mode.
- ``cpu_shim``: the few patches that let Megatron-Core run on CPU with gloo.
- ``engine``: ``MegatronEngine`` (TrainEngine API: train_batch, forward, save/load, ...).
- ``packing``: token-budget packing of trajectories into micro-batches.
- ``lm_head``: what losses receive: hidden states + a vocab-parallel LM head.
- ``optim``: Megatron's distributed optimizer and the LR schedules.
- ``checkpoint``: Megatron distributed checkpoints and HF export.
- ``losses`` / ``advantages``: the pure PPO / GRPO functions.
- ``ppo``: ``MegatronPPOActor`` (compute_logp, compute_advantages, ppo_update).
"""
