"""bf16 training on a CPU without native bf16: bf16 tensors throughout, each matrix product in fp32.

Hardware with native bf16 (AVX-512 BF16 or AMX CPUs, every recent GPU) multiplies bf16
operands with fp32 accumulation and rounds the product to bf16. A CPU with AVX2 only runs
PyTorch's bf16 matrix products over 100x slower than fp32 (``benchmarks/bf16_matmul.py``), so bf16 training there is not
practical, yet it is what GPUs run and must be checkable. :class:`emulated_bf16_matmuls`
runs the same arithmetic at fp32 speed: inside it, a matrix product (``mm``, ``addmm``,
``bmm``, ``baddbmm``, forward and backward) with bf16 operands widens them to fp32 exactly,
multiplies in fp32 and rounds the result to bf16. Weights, activations and gradients keep
their bf16 storage and every rounding of the native path; only the order of the fp32 sums
may differ. Everything else runs as it is: elementwise ops (PyTorch's CPU kernels compute
them in fp32 and round, as native hardware does) and attention, whose CPU flash kernel runs
bf16 at fp32 speed without native bf16 and rounds its probabilities to bf16 as on GPUs
(an fp32 attention would not: it moved tiny-model logprobs 13x further from native bf16
than the emulated products do).

The engine enters it around its forward and backward passes when ``actor.emulate_bf16`` is set.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from megarl.actor import cpu_shim

aten = torch.ops.aten

_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def _widen(value):
    return value.float() if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else value


def _has_bf16(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args)


class emulated_bf16_matmuls(TorchDispatchMode):  # noqa: N801 - used like a function: `with emulated_bf16_matmuls():`
    """Context manager: bf16 matrix products computed in fp32, rounded back to bf16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and _has_bf16(args):
            out = func(*tree_map(_widen, args), **tree_map(_widen, kwargs))
            return out.to(torch.bfloat16)
        return func(*args, **kwargs)


def compute_mode(emulate_bf16: bool) -> contextlib.AbstractContextManager:
    """What an engine's forward and backward passes run under: the CPU shim, and bf16 emulation if asked
    for (``actor.emulate_bf16``, refused on CUDA, which has bf16 arithmetic)."""
    if not emulate_bf16:
        return cpu_shim.device_mode()
    if cpu_shim.cuda_available():
        raise ValueError("actor.emulate_bf16 emulates bf16 arithmetic on CPUs without it; CUDA has it: unset it")
    stack = contextlib.ExitStack()
    stack.enter_context(cpu_shim.device_mode())
    stack.enter_context(emulated_bf16_matmuls())
    return stack
