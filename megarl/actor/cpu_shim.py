"""Make Megatron-Core run on a machine without CUDA (gloo, CPU tensors).

Megatron-Core 0.16 hard-codes ``"cuda"`` in a few places that the CPU path goes
through: the pipeline schedules and the distributed optimizer allocate with
``device="cuda"`` or ``torch.cuda.current_device()``, buffers call ``.cuda()``, the
optimizer checks ``param.type() == "torch.cuda.FloatTensor"``, MoE code creates
``torch.cuda.Stream`` objects, and the RNG tracker seeds the CUDA generator. This
module answers those calls on the CPU and nothing else:

* :func:`install` (idempotent, a no-op when CUDA is available) patches the few
  ``torch.cuda`` entry points and Megatron module attributes listed above;
* :func:`device_mode` returns a context manager that maps ``device="cuda"``
  arguments, ``.cuda()`` and ``Tensor.type()`` to their CPU meaning while
  Megatron code runs. The engine enters it around its public calls only, so the
  rest of the process (HF reference models, data code) sees plain torch.

:func:`install` also skips the gradient reduce-scatter and parameter all-gather of Megatron's
distributed optimizer over a group of one rank (:func:`_skip_one_rank_collectives`): gloo copies
a buffer onto itself there, two passes over the model's memory every step of a one-rank trainer.

On a CUDA machine both are no-ops: the GPU path never depends on this module.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

# install() runs once per process; the lock only guards that one transition.
_INSTALL_LOCK = threading.Lock()

_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def cuda_available() -> bool:
    """Whether the GPU path applies (then nothing here is used)."""
    return torch.cuda.is_available()


def _to_cpu_device(value):
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, int) and not isinstance(value, bool):
        return "cpu"  # a CUDA ordinal such as torch.cuda.current_device()'s answer
    return value


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU inside Megatron calls."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _TYPE_NAMES.get(args[0].dtype, func(*args))
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_to_cpu_device(kwargs["device"]))
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _InertStream:
    """Stands in for ``torch.cuda.Stream`` / ``Event``: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _InertStream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.Stream = _InertStream
    cuda.Event = _InertStream
    cuda.current_stream = lambda *a, **k: _InertStream()
    cuda.default_stream = lambda *a, **k: _InertStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    # The RNG tracker saves, seeds and restores "the CUDA generator"; on CPU the
    # generator that dropout and init actually use is the CPU one.
    cuda.manual_seed = torch.manual_seed
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` on CPU: the tensor is already there, but the alltoall
    dispatcher's split sizes must still become the numpy arrays ``all_to_all_single`` takes as lists."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _uneven_gather(original):
    """Megatron's ``_gather_along_first_dim``, whose blocks of uneven sizes (``output_split_sizes``: the
    alltoall dispatcher's tokens per expert-tensor-parallel rank) gloo cannot all-gather: each block is
    padded to the largest, gathered, and cut back."""

    def call(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        blocks = input_.new_empty((group.size() * padded.shape[0], *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(blocks, padded.contiguous(), group=group)
        return torch.cat([block[:n] for block, n in zip(blocks.chunk(group.size()), sizes)])

    return call


def _uneven_reduce_scatter(original):
    """Megatron's ``_reduce_scatter_along_first_dim`` (the backward of :func:`_uneven_gather`), whose
    uneven blocks gloo cannot reduce-scatter: the whole tensor is all-reduced and this rank's block kept."""

    def call(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        sizes, rank = [int(n) for n in input_split_sizes], group.rank()
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[:rank])
        return total[start : start + sizes[rank]].clone()

    return call


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # megatron-core 0.16.1 only defines this name when TransformerEngine imports.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    mappings._gather_along_first_dim = _uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)


def _one_rank_shortcut(collective):
    """``collective`` (an all-gather or reduce-scatter into ``output`` from ``input``), which over a group
    of one rank is a copy: gloo makes it one even when the two are the same memory, as they are in
    Megatron's gradient and parameter buffers (each rank's shard of a one-rank group is the whole
    buffer). That is a pass over the fp32 gradients and another over the parameters every step."""

    def call(output, input, group=None, async_op=False, **kwargs):
        if torch.distributed.get_world_size(group) != 1:
            return collective(output, input, group=group, async_op=async_op, **kwargs)
        if output.data_ptr() != input.data_ptr() or output.numel() != input.numel():
            output.copy_(input.view(output.shape))
        return _InertStream() if async_op else None

    call.__wrapped__ = collective
    return call


def _skip_one_rank_collectives() -> None:
    """Megatron's distributed optimizer reduce-scatters the gradients and all-gathers the parameters
    over the data-parallel group each step; with one data-parallel rank (a CPU run's usual layout)
    both are copies of a buffer onto itself, skipped here."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        setattr(buffers, name, _one_rank_shortcut(getattr(buffers, name)))


def install() -> None:
    """Patch ``torch.cuda`` and Megatron for CPU execution (once; no-op with CUDA)."""
    if cuda_available():
        return
    with _INSTALL_LOCK:
        if getattr(torch.cuda, "_megarl_cpu_shim", False):
            return
        _patch_torch_cuda()
        _patch_megatron()
        _skip_one_rank_collectives()
        torch.cuda._megarl_cpu_shim = True
    logger.info("CUDA unavailable: Megatron-Core runs on CPU through megarl.actor.cpu_shim")


def device_mode() -> contextlib.AbstractContextManager:
    """Context in which Megatron's CUDA placements land on CPU (null context with CUDA)."""
    if cuda_available():
        return contextlib.nullcontext()
    install()
    return _CudaToCpuMode()


def device() -> torch.device:
    """The device model tensors live on: the current CUDA device, else CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
