"""The CUDA path: loading ``megarl._C`` (prebuilt by setup.py, else JIT-built from ``csrc/``)
and the thin Python drivers around its kernels.

What is fused (see ``csrc/``): the forward is one kernel per shard (tiled bf16 GEMM with an
online-logsumexp epilogue; per-split partials merged here in torch: O(splits x T) floats).
The backward recomputes logit tiles in a kernel that writes the softmax gradient as a bf16
chunk dz [T, chunk]; the two gradient GEMMs (dH += dz . W_c, dW_c = dz^T . H) run on cuBLAS.

Two mainloops compute the logit tiles: TMA + wgmma on Hopper (sm_90a), ldmatrix + mma.sync
elsewhere (sm_80 and later). ``MEGARL_CUDA_MAINLOOP=sm80`` forces the second on Hopper too.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path
from types import ModuleType

import torch

from megarl.kernels.reference import VocabShard, merge_stats

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
TILE = 128  # kTileTokens == kTileVocab in csrc/kernels.h
MAINLOOPS = ("auto", "sm80", "sm90")


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """nvcc -gencode flags of a JIT build for a device of this compute capability.

    Hopper needs the arch-specific sm_90a target for wgmma, which torch's default flags
    (sm_90) leave out; every other device gets its own SASS.
    """
    major, minor = capability
    if (major, minor) == (9, 0):
        return ["-gencode=arch=compute_90a,code=sm_90a"]
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled kernels, or None where CUDA is absent or they cannot be built.

    Order: the ``megarl._C`` module that setup.py builds; else a JIT build of ``csrc/`` with
    ``torch.utils.cpp_extension.load`` (cached by torch under ``TORCH_EXTENSIONS_DIR``).
    ``MEGARL_DISABLE_CUDA_KERNELS=1`` turns the CUDA path off.
    """
    if os.environ.get("MEGARL_DISABLE_CUDA_KERNELS") == "1" or not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability()
    if capability < (8, 0):
        logger.warning(
            "the megarl CUDA kernels need sm_80 or newer, this GPU is sm_%d%d: using the torch path", *capability
        )
        return None
    try:
        from megarl import _C  # type: ignore[attr-defined]

        return _C
    except ImportError:
        pass
    sources = sorted(str(p) for p in CSRC.glob("*") if p.suffix in (".cu", ".cpp"))
    if not sources:
        logger.warning("megarl._C is not built and %s has no sources: using the torch path", CSRC)
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.info("JIT-building the megarl CUDA kernels from %s (first use only)", CSRC)
        return load(
            name="megarl_C",
            sources=sources,
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "--use_fast_math", *arch_flags(capability)],
        )
    except Exception as exc:  # noqa: BLE001 (a failed build must not take training down: fall back)
        logger.warning("could not JIT-build the megarl CUDA kernels (%s): using the torch path", exc)
        return None


def unavailable_reason() -> str | None:
    """Why :func:`load_extension` gives None, or None when the kernels load."""
    if load_extension() is not None:
        return None
    if os.environ.get("MEGARL_DISABLE_CUDA_KERNELS") == "1":
        return "MEGARL_DISABLE_CUDA_KERNELS=1 is set"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    if torch.cuda.get_device_capability() < (8, 0):
        return "the GPU is older than sm_80 (the kernels use cp.async and bf16 tensor-core MMA)"
    return "megarl._C is not built and JIT-building csrc/ failed (see the warning logged above)"


def supports(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the CUDA logprob kernel applies to these operands (and is loadable)."""
    return (
        hidden.is_cuda
        and hidden.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and hidden.shape[-1] % 8 == 0
        and load_extension() is not None
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_SM90_KNOWN: dict[int, bool] = {}  # device index -> definite answer of the sm_90a probe


def _sm90_available(device_index: int) -> bool:
    """Whether the wgmma mainloop runs on this device, from the extension's probe.

    A definite answer is cached per device (no CUDA context switch on every forward). A probe
    that failed (an allocation, the probe launch) is logged as a warning naming the error and
    asked again at the next call, so a transient failure does not turn the path off for good;
    a Hopper GPU without the path (no sm_90a code, a register count the setmaxnreg split cannot
    use) is logged once as a warning too.
    """
    if device_index not in _SM90_KNOWN:
        with torch.cuda.device(device_index):
            available, definite, reason = load_extension().sm90_mainloop_status()
        return _record_sm90_status(device_index, available, definite, reason)
    return _SM90_KNOWN[device_index]


def _record_sm90_status(device_index: int, available: bool, definite: bool, reason: str) -> bool:
    if not definite:
        logger.warning(
            "the sm_90a (wgmma) probe failed on cuda:%d, using the sm80 mainloop for this call "
            "and probing again at the next: %s",
            device_index,
            reason,
        )
        return False
    _SM90_KNOWN[device_index] = available
    if not available and not reason.startswith("the device is sm_"):
        logger.warning(
            "the sm_90a (wgmma) mainloop cannot run on cuda:%d, using the sm80 mainloop: %s", device_index, reason
        )
    return available


def use_wgmma(device: torch.device) -> bool:
    """Whether the kernels on this device run the Hopper (TMA + wgmma) mainloop.

    ``MEGARL_CUDA_MAINLOOP``: "auto" (default) takes it wherever the device and the build
    have it, "sm80" never, "sm90" always (an error where it cannot run).
    """
    choice = os.environ.get("MEGARL_CUDA_MAINLOOP", "auto")
    if choice not in MAINLOOPS:
        raise ValueError(f"MEGARL_CUDA_MAINLOOP must be one of {MAINLOOPS}, got {choice!r}")
    if choice == "sm80":
        return False
    available = _sm90_available(device.index if device.index is not None else torch.cuda.current_device())
    if choice == "sm90" and not available:
        raise RuntimeError(
            "MEGARL_CUDA_MAINLOOP=sm90, but the wgmma mainloop cannot run here: it needs an sm_90 "
            "GPU and an extension built with -gencode=arch=compute_90a,code=sm_90a (see the warning "
            "logged by the probe for this device's reason)"
        )
    return available


def num_splits(num_tokens: int, valid: int, device: torch.device, vocab_tile: int = TILE) -> int:
    """Vocab splits per token block: enough CTAs for two waves, and at least 16 splits so that
    the CTAs running together share few token blocks of hidden (L2 reuse)."""
    token_blocks = math.ceil(num_tokens / TILE)
    vocab_tiles = max(1, math.ceil(valid / vocab_tile))
    wanted = max(16, math.ceil(2 * _num_sms(device.index or 0) / token_blocks))
    return min(vocab_tiles, wanted)


def _operand(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and 16-byte aligned, as both mainloops' 16-byte row loads need."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def local_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    inv_tau: float,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """This shard's (m, s, u, label_logit) ``[T]`` from the fused forward kernel; with ``logits``
    (fp32 ``[T, >=valid]``) its storing variant also writes the raw logits there."""
    ext = load_extension()
    wgmma = use_wgmma(hidden.device)
    vocab_tile = ext.TILE_VOCAB_SM90 if wgmma else ext.TILE_VOCAB
    splits = num_splits(hidden.shape[0], shard.valid, hidden.device, vocab_tile)
    part, label_logit = ext.logprob_forward(
        _operand(hidden),
        _operand(weight),
        labels.long().contiguous(),
        shard.valid,
        shard.start,
        inv_tau,
        splits,
        wgmma,
        logits,
    )  # part: [3, splits, T]
    m, s, u = merge_stats(part[0], part[1], part[2])
    return m, s, u, label_logit


def logits_and_stats(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shard: VocabShard, inv_tau: float
) -> tuple[torch.Tensor, ...]:
    """The training path's forward of a token chunk (``linear_loss.ChunkOps``): (its raw logits
    x = hidden · weightᵀ fp32 ``[T, valid rounded up to even]``, m, s, u, label_logit), one kernel."""
    logits = torch.empty(hidden.shape[0], shard.valid + shard.valid % 2, dtype=torch.float32, device=hidden.device)
    stored = logits if shard.valid > 0 else None  # an all-padding shard has no logits
    return logits, *local_stats(hidden, weight, labels, shard, inv_tau, stored)


def softmax_grad_stored(
    logits: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    inv_tau: float,
    lse: torch.Tensor,
    mean_z: torch.Tensor,
    g_logprob: torch.Tensor,
    g_entropy: torch.Tensor,
) -> torch.Tensor:
    """dL/dx bf16 ``[T, valid]`` (a view with the logits' row stride) from the logits that
    :func:`logits_and_stats` stored, once the chunk's statistics and loss gradients are known."""
    dz = torch.empty(logits.shape, dtype=torch.bfloat16, device=logits.device)
    vectors = [t.float().contiguous() for t in (lse, mean_z, g_logprob, g_entropy)]
    if shard.valid > 0:
        load_extension().softmax_grad_stored(
            logits, labels.long().contiguous(), shard.valid, shard.start, inv_tau, *vectors, dz
        )
    return dz[:, : shard.valid]


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc(fp32) += a @ b for bf16 a, b, accumulating in fp32 inside cuBLAS where torch can."""
    try:
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError):  # torch without addmm(out_dtype=...)
        return acc.add_(a @ b)


def grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    inv_tau: float,
    lse: torch.Tensor,
    mean_z: torch.Tensor,
    g_logprob: torch.Tensor,
    g_entropy: torch.Tensor,
    chunk_vocab: int,
    need_hidden: bool = True,
    need_weight: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dhidden [T,H] fp32, dweight [V_local,H] bf16), same contract as ``reference.grads_chunked``.

    Extra memory: a bf16 dz chunk [T, chunk_vocab] and the fp32 dhidden accumulator.
    """
    ext = load_extension()
    wgmma = use_wgmma(hidden.device)
    hidden, weight = _operand(hidden), _operand(weight)
    labels = labels.long().contiguous()
    num_tokens = hidden.shape[0]
    chunk = max(TILE, chunk_vocab // TILE * TILE)  # even, tile-aligned chunk starts
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
    d_weight = torch.empty_like(weight) if need_weight else None
    if d_weight is not None:
        d_weight[shard.valid :].zero_()  # padding rows
    width = min(chunk, shard.valid + shard.valid % 2)  # even row stride for bf16x2 stores
    dz_buf = torch.empty(num_tokens, width, dtype=torch.bfloat16, device=hidden.device)
    vectors = [t.float().contiguous() for t in (lse, mean_z, g_logprob, g_entropy)]
    for v0 in range(0, shard.valid, chunk):
        v1 = min(v0 + chunk, shard.valid)
        ext.logprob_backward_dz(
            hidden, weight, labels, shard.valid, shard.start, inv_tau, *vectors, v0, v1 - v0, dz_buf, wgmma
        )
        dz = dz_buf[:, : v1 - v0]  # [T,vc]
        if d_weight is not None:
            torch.mm(dz.T, hidden, out=d_weight[v0:v1])
        if d_hidden is not None:
            _addmm_fp32(d_hidden, dz, weight[v0:v1])
    return d_hidden, d_weight
