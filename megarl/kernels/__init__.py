"""Fused kernels of the actor: token logprob + entropy from hidden states over a vocab-parallel
LM head, and the PPO/GRPO loss epilogue.

Each entry point runs the CUDA kernels from ``csrc/`` (``megarl._C``, prebuilt or JIT-built)
when the inputs are on a GPU and fit them, and an exact chunked torch implementation
otherwise; neither materialises the [tokens x vocab] logits. ``backend="torch"`` forces the
reference, ``MEGARL_DISABLE_CUDA_KERNELS=1`` turns the CUDA path off process-wide.
"""

from megarl.kernels.logprob import fused_logprobs_entropy
from megarl.kernels.ppo_loss import PPOLossStats, fused_ppo_loss
from megarl.kernels.reference import logprobs_entropy_naive

__all__ = ["fused_logprobs_entropy", "fused_ppo_loss", "PPOLossStats", "logprobs_entropy_naive"]
