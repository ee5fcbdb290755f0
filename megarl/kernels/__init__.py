"""Fused kernels of the actor: token logprob + entropy from hidden states over a vocab-parallel
LM head, and the PPO/GRPO loss epilogue.

Each entry point runs the CUDA kernels from ``csrc/`` (``megarl._C``, prebuilt or JIT-built)
when the inputs are on a GPU and fit them, and an exact chunked torch implementation
otherwise; neither materialises the [tokens x vocab] logits. ``backend="torch"`` forces the
reference, ``MEGARL_DISABLE_CUDA_KERNELS=1`` turns the CUDA path off process-wide. Engines
choose the backend from their ``use_fused_kernels`` flag with ``resolve_backend``.
"""

from megarl.kernels.backend import Backend, resolve_backend
from megarl.kernels.logprob import fused_logprobs_entropy, logprobs_backend
from megarl.kernels.ppo_loss import PPOLossStats, fused_ppo_loss, ppo_loss_backend
from megarl.kernels.reference import logprobs_entropy_naive

__all__ = [
    "Backend",
    "PPOLossStats",
    "fused_logprobs_entropy",
    "fused_ppo_loss",
    "logprobs_backend",
    "logprobs_entropy_naive",
    "ppo_loss_backend",
    "resolve_backend",
]
