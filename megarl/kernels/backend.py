"""Which implementation the fused-kernel entry points run: their ``backend`` argument, and the
engines' ``use_fused_kernels`` flag that chooses it.

``"cuda"`` runs the kernels from ``csrc/`` and fails where they cannot run, ``"torch"`` runs the
exact chunked torch path, ``"auto"`` takes CUDA wherever it applies and torch elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from megarl.kernels import _cuda

Backend = Literal["auto", "cuda", "torch"]


def pick_backend(backend: Backend, cuda_applies: Callable[[], bool], needs: str) -> Literal["cuda", "torch"]:
    """The implementation one call runs.

    ``cuda_applies`` says whether the CUDA kernel can take this call's operands; it is only
    asked when ``backend`` is not "torch" (it may load, even JIT-build, the extension).
    ``needs`` completes the error of a ``"cuda"`` request it cannot serve.
    """
    if backend not in ("auto", "cuda", "torch"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'torch', got {backend!r}")
    if backend == "torch":
        return "torch"
    if cuda_applies():
        return "cuda"
    if backend == "cuda":
        raise ValueError(f"backend='cuda' needs {needs}")
    return "torch"


def resolve_backend(use_fused_kernels: bool | None, params_dtype: torch.dtype, hidden_size: int) -> Backend:
    """The backend of an engine with this ``use_fused_kernels`` flag, parameter dtype and hidden size.

    None gives "auto" and False "torch". True gives "cuda" after checking here, at engine
    initialisation, what the kernels need (the extension, a GPU where a mainloop passes its
    self-check, bf16 weights, H % 8 == 0), so
    that a machine or model they cannot serve fails with an error naming the flag instead of
    inside the first forward.
    """
    if use_fused_kernels is None:
        return "auto"
    if not use_fused_kernels:
        return "torch"
    problems = []
    reason = _cuda.unavailable_reason()
    if reason is not None:
        problems.append(reason)
    elif (found := _cuda.verified_path(_current_cuda_device())).check is None:
        problems.append(f"on this GPU they take the {found.describe()}")
    if params_dtype != torch.bfloat16:
        problems.append(f"they run bf16 weights and the engine's dtype is {params_dtype}")
    if hidden_size % 8:
        problems.append(f"they need a hidden size divisible by 8, got {hidden_size}")
    if problems:
        raise ValueError(
            "use_fused_kernels=True but the fused CUDA kernels cannot run: "
            + "; ".join(problems)
            + ". Set use_fused_kernels=None to use them only where they apply, or False for the torch path."
        )
    return "cuda"


def _current_cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def kernel_summary(backend: Backend) -> str:
    """What the fused logprob kernels run on this process's GPU under ``backend``, for the run's
    log, e.g. "cuda sm80 (verified: max |diff| 3.1e-07)" or "torch (no CUDA device is available)".
    Runs the self-check of the CUDA path where it has not run yet."""
    if backend == "torch":
        return "torch (use_fused_kernels=False)"
    reason = _cuda.unavailable_reason()
    if reason is not None:
        return f"torch ({reason})"
    return f"{_cuda.verified_path(_current_cuda_device()).describe()}; kernels: {_cuda.build_origin()}"
