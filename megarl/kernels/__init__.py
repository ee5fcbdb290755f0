"""Fused kernels of the actor: token logprob + entropy from hidden states over a vocab-parallel
LM head (the PPO/GRPO loss epilogue's entry point, which needs the actor's loss, is
``megarl.actor.fused_ppo_loss``).

Each entry point runs the CUDA kernels from ``csrc/`` (``megarl._C``, prebuilt or JIT-built)
when the inputs are on a GPU and fit them, and an exact chunked torch implementation
otherwise; neither materialises the [tokens x vocab] logits. ``backend="torch"`` forces the
reference, ``MEGARL_DISABLE_CUDA_KERNELS=1`` turns the CUDA path off process-wide. Engines
choose the backend from their ``use_fused_kernels`` flag with ``resolve_backend``. The CUDA
kernels pass a self-check on each device before first use (``megarl.kernels.selfcheck``);
``active_path`` and ``kernel_summary`` say which path runs.
"""

from megarl.kernels._cuda import PATH_CODES, active_path
from megarl.kernels.backend import Backend, kernel_summary, resolve_backend
from megarl.kernels.logprob import fused_logprobs_entropy, logprobs_backend
from megarl.kernels.reference import logprobs_entropy_naive
from megarl.kernels.truncation import Truncation

__all__ = [
    "PATH_CODES",
    "Truncation",
    "Backend",
    "active_path",
    "fused_logprobs_entropy",
    "kernel_summary",
    "logprobs_backend",
    "logprobs_entropy_naive",
    "resolve_backend",
]
