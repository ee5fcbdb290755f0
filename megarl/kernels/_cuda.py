"""The CUDA path: loading ``megarl._C`` (prebuilt by setup.py, else JIT-built from ``csrc/``)
and the thin Python drivers around its kernels.

What is fused (see ``csrc/``): the forward is one kernel per shard (tiled bf16 GEMM with an
online-logsumexp epilogue; per-split partials merged here in torch: O(splits x T) floats).
The backward recomputes logit tiles in a kernel that writes the softmax gradient as a bf16
chunk dz [T, chunk]; the two gradient GEMMs (dH += dz . W_c, dW_c = dz^T . H) run on cuBLAS.
Under truncation replay the backward kernels take the per-token threshold that the torch forward
(``truncation.truncated_stats``) found and leave the tokens below it out of the softmax.

Two mainloops compute the logit tiles: TMA + wgmma on Hopper (sm_90a), ldmatrix + mma.sync
elsewhere (sm_80 and later). Before a process uses one on a device, it passes a self-check
(``megarl.kernels.selfcheck``); one that fails gives way to the next, sm90 -> sm80 -> the torch
path, with one warning (:func:`kernel_path`). ``MEGARL_CUDA_MAINLOOP=sm80|sm90`` forces a mainloop,
which must pass its check too. ``MEGARL_CUDA_CTA_GROUP=N`` sets the order in which the kernels' CTAs
take their tiles (:func:`cta_group`): the speed, never the results.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from megarl.kernels import selfcheck
from megarl.kernels.reference import VocabShard, merge_stats

logger = logging.getLogger(__name__)

TILE = 128  # kTileTokens == kTileVocab in csrc/kernels.h
MAINLOOPS = ("auto", "sm80", "sm90")
CSRC = Path(__file__).resolve().parents[2] / "csrc"
"""The kernels' sources in a source checkout (an editable install runs from one)."""
PACKAGED_CSRC = Path(__file__).resolve().parents[1] / "_csrc"
"""The same sources as every wheel ships them (setup.py copies csrc/ into the package)."""


def kernel_sources() -> Path | None:
    """Where the JIT build finds the CUDA sources: the checkout's ``csrc/``, else the copy a
    wheel or regular install ships in ``megarl/_csrc``; None when neither has them."""
    for folder in (CSRC, PACKAGED_CSRC):
        if any(folder.glob("*.cu")):
            return folder
    return None


def build_origin() -> str:
    """How :func:`load_extension` got (or would get) the kernels, for the start-up line: the
    extension built at install, or a JIT build from which sources, or why neither is there."""
    try:
        from megarl import _C  # type: ignore[attr-defined]  # noqa: F401

        return "megarl._C, built at install"
    except ImportError:
        pass
    sources = kernel_sources()
    if sources is None:
        return f"no kernels: megarl._C was not built at install and neither {CSRC} nor {PACKAGED_CSRC} has the sources"
    return (
        f"JIT-built from {sources} (megarl._C was not built at install: the build saw no CUDA torch "
        "or toolkit; `pip install --no-build-isolation` builds it against your torch)"
    )


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """nvcc -gencode flags of a JIT build for a device of this compute capability.

    Hopper needs the arch-specific sm_90a target for wgmma, which torch's default flags
    (sm_90) leave out; every other device gets its own SASS.
    """
    major, minor = capability
    if (major, minor) == (9, 0):
        return ["-gencode=arch=compute_90a,code=sm_90a"]
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


def extra_build_flags() -> tuple[list[str], list[str]]:
    """(host C++ flags, nvcc flags) an operator adds to the extension's build without editing it:
    ``MEGARL_CXX_FLAGS`` and ``MEGARL_NVCC_FLAGS``, split as a shell would (setup.py reads the same)."""
    return shlex.split(os.environ.get("MEGARL_CXX_FLAGS", "")), shlex.split(os.environ.get("MEGARL_NVCC_FLAGS", ""))


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled kernels, or None where CUDA is absent or they cannot be built.

    Order: the ``megarl._C`` module that setup.py builds; else a JIT build of ``csrc/`` with
    ``torch.utils.cpp_extension.load`` (cached by torch under ``TORCH_EXTENSIONS_DIR``).
    ``MEGARL_DISABLE_CUDA_KERNELS=1`` turns the CUDA path off. The JIT build adds
    :func:`extra_build_flags` (torch rebuilds when they change).
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
    folder = kernel_sources()
    if folder is None:
        logger.warning("%s: using the torch path", build_origin())
        return None
    sources = sorted(str(p) for p in folder.glob("*") if p.suffix in (".cu", ".cpp"))
    try:
        from torch.utils.cpp_extension import load

        cxx_flags, nvcc_flags = extra_build_flags()
        logger.info("JIT-building the megarl CUDA kernels from %s (first use only)", folder)
        return load(
            name="megarl_C",
            sources=sources,
            extra_include_paths=[str(folder)],
            extra_cflags=["-O3", *cxx_flags],
            extra_cuda_cflags=["-O3", "--use_fast_math", *arch_flags(capability), *nvcc_flags],
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
    if (sources := kernel_sources()) is None:
        return build_origin()
    return f"megarl._C is not built and JIT-building {sources} failed (see the warning logged above)"


def operands_fit(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the CUDA logprob kernels take these operands: CUDA bf16 with H % 8 == 0."""
    return (
        hidden.is_cuda
        and hidden.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and hidden.shape[-1] % 8 == 0
    )


def supports(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the CUDA logprob kernels run for these operands: they fit, the extension loads, and
    a mainloop passed its self-check on their device (:func:`kernel_path`)."""
    return operands_fit(hidden, weight) and load_extension() is not None and kernel_path(hidden.device) != "torch"


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


def _mainloop_choice() -> str:
    choice = os.environ.get("MEGARL_CUDA_MAINLOOP", "auto")
    if choice not in MAINLOOPS:
        raise ValueError(f"MEGARL_CUDA_MAINLOOP must be one of {MAINLOOPS}, got {choice!r}")
    return choice


CTA_GROUP_MAX = 32
"""Token blocks per group of the default CTA order, at most (``DEFAULT_CTA_GROUP`` of the extension)."""
CTA_GROUP_HIDDEN_BYTES = 32 * 2**20
"""And at most this much of hidden rows per group (bf16 ``[TILE, H]`` per token block): 16 blocks at H = 8192."""


def default_cta_group(hidden_size: int) -> int:
    """At most :data:`CTA_GROUP_MAX` token blocks whose hidden rows fit :data:`CTA_GROUP_HIDDEN_BYTES`: the
    groups that ``benchmarks/cta_order_model.py`` finds to move the least DRAM traffic on an H200."""
    return max(1, min(CTA_GROUP_MAX, CTA_GROUP_HIDDEN_BYTES // (TILE * hidden_size * 2)))


def cta_group(hidden_size: int) -> int:
    """Token blocks per group of the kernels' CTA order (``csrc/cta_order.cuh``): ``MEGARL_CUDA_CTA_GROUP``
    when set (1 is the column-fastest order, every vocab split of a token block before the next block),
    else :func:`default_cta_group`."""
    value = os.environ.get("MEGARL_CUDA_CTA_GROUP", "")
    if not value:
        return default_cta_group(hidden_size)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"MEGARL_CUDA_CTA_GROUP must be an integer >= 1 (token blocks per group), got {value!r}")
    return int(value)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


@dataclass(frozen=True)
class KernelPath:
    """What the fused kernels run on a device: "sm90" or "sm80" (a mainloop that passed its
    self-check) or "torch" (none did), and the checks of the mainloops that failed before it."""

    path: str
    check: selfcheck.CheckResult | None
    failed: tuple[selfcheck.CheckResult, ...] = ()

    def describe(self) -> str:
        """e.g. "cuda sm80 (verified: max |diff| 3.1e-07; sm90 failed its self-check: ...)"."""
        failures = "; ".join(f"{r.mainloop} {r.describe()}" for r in self.failed)
        if self.check is None:
            return f"torch (no CUDA mainloop passed its self-check: {failures})"
        return f"cuda {self.path} ({'; '.join(filter(None, [self.check.describe(), failures]))})"


PATH_CODES = {"torch": 0.0, "sm80": 80.0, "sm90": 90.0}
"""A path as a number, for metrics."""

_CHECKS: dict[tuple[str, str], selfcheck.CheckResult] = {}  # (device, mainloop) -> its self-check
_PATHS: dict[tuple[str, str], KernelPath] = {}  # (device, MEGARL_CUDA_MAINLOOP) -> the settled path
_ACTIVE: dict[str, KernelPath] = {}  # device -> the path its latest call took


def _self_check(device: torch.device, mainloop: str) -> selfcheck.CheckResult:
    drivers = selfcheck.Drivers(local_stats, logits_and_stats, softmax_grad_stored, grads)
    return selfcheck.run_check(drivers, device, mainloop)


def _candidates(device: torch.device, choice: str) -> tuple[list[str], bool]:
    """The mainloops to try in order, and whether that list is final (the sm_90a probe answered)."""
    if choice == "sm80":
        return ["sm80"], True
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    available = _sm90_available(index)
    if choice == "sm90" and not available:
        raise RuntimeError(
            "MEGARL_CUDA_MAINLOOP=sm90, but the wgmma mainloop cannot run here: it needs an sm_90 "
            "GPU and an extension built with -gencode=arch=compute_90a,code=sm_90a (see the warning "
            "logged by the probe for this device's reason)"
        )
    if choice == "sm90":
        return ["sm90"], True
    return (["sm90", "sm80"] if available else ["sm80"]), index in _SM90_KNOWN


def _first_passing(device: torch.device, name: str, candidates: list[str]) -> tuple[KernelPath, list]:
    """The first candidate whose self-check passes (checks run once per device and mainloop), and
    the checks that failed in this call for the first time."""
    failed, fresh = [], []
    for mainloop in candidates:
        if (name, mainloop) not in _CHECKS:
            _CHECKS[name, mainloop] = _self_check(device, mainloop)
            fresh.append(_CHECKS[name, mainloop])
        result = _CHECKS[name, mainloop]
        if result.passed:
            return KernelPath(mainloop, result, tuple(failed)), [r for r in fresh if not r.passed]
        failed.append(result)
    return KernelPath("torch", None, tuple(failed)), [r for r in fresh if not r.passed]


def _choose(device: torch.device) -> KernelPath:
    choice, name = _mainloop_choice(), _device_name(device)
    if (name, choice) in _PATHS:
        _ACTIVE[name] = _PATHS[name, choice]
        return _ACTIVE[name]
    candidates, final = _candidates(device, choice)
    found, newly_failed = _first_passing(device, name, candidates)
    if choice != "auto" and found.check is None:
        # a forced mainloop is what the operator asked to run or measure: failing is an error
        raise RuntimeError(
            f"MEGARL_CUDA_MAINLOOP={choice} forces the {choice} kernels, but on {name} they "
            f"{found.failed[0].describe()}. Unset it to let the kernels fall back (sm90 -> sm80 -> torch)."
        )
    if newly_failed:
        logger.warning("fused kernels on %s: %s", name, found.describe())
    if final:
        _PATHS[name, choice] = found
    _ACTIVE[name] = found
    return found


def verified_path(device: torch.device) -> KernelPath:
    """The path the fused kernels take on this device (see :func:`kernel_path`), with its checks."""
    return _choose(device)


def kernel_path(device: torch.device) -> str:
    """The path the fused kernels take on this device: "sm90", "sm80" or "torch".

    Under ``MEGARL_CUDA_MAINLOOP`` "auto" (default): the first of sm90 (where the device and the
    build have it) and sm80 that passes its self-check on this device, else the torch path; one
    warning names each mainloop that failed, its error or largest difference, and the path taken.
    "sm80" or "sm90" forces that mainloop: failing its check (or an sm90 that cannot run) is a
    RuntimeError naming it, not a fallback. Each check runs once per device and process.
    """
    return _choose(device).path


def active_path(device: torch.device | str | None = None) -> str | None:
    """The path the latest call on ``device`` (default: the current CUDA device) took, or None
    before any: what the run's log and metrics report."""
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    return (found := _ACTIVE.get(_device_name(torch.device(device)))) and found.path


def use_wgmma(device: torch.device) -> bool:
    """Whether the drivers run the Hopper (TMA + wgmma) mainloop on this device: the verified path."""
    return kernel_path(device) == "sm90"


def _wgmma(device: torch.device, mainloop: str | None) -> bool:
    """A driver's mainloop: the one named (the self-check pins it), else the verified one."""
    return use_wgmma(device) if mainloop is None else mainloop == "sm90"


def num_splits(num_tokens: int, valid: int, device: torch.device, vocab_tile: int = TILE) -> int:
    """Vocab splits per token block on ``device``: :func:`splits_for` with its SM count."""
    return splits_for(num_tokens, valid, _num_sms(device.index or 0), vocab_tile)


def splits_for(num_tokens: int, valid: int, num_sms: int, vocab_tile: int = TILE) -> int:
    """Vocab splits per token block: enough CTAs for two waves, and at least 16 splits so that
    the CTAs running together share few token blocks of hidden (L2 reuse)."""
    token_blocks = math.ceil(num_tokens / TILE)
    vocab_tiles = max(1, math.ceil(valid / vocab_tile))
    wanted = max(16, math.ceil(2 * num_sms / token_blocks))
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
    mainloop: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """This shard's (m, s, u, label_logit) ``[T]`` from the fused forward kernel; with ``logits``
    (fp32 ``[T, >=valid]``) its storing variant also writes the raw logits there. ``mainloop``:
    "sm80" or "sm90", default the device's verified one (:func:`kernel_path`)."""
    ext = load_extension()
    wgmma = _wgmma(hidden.device, mainloop)
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
        cta_group=cta_group(hidden.shape[1]),
    )  # part: [3, splits, T]
    m, s, u = merge_stats(part[0], part[1], part[2])
    return m, s, u, label_logit


def logits_and_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    inv_tau: float,
    mainloop: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """The training path's forward of a token chunk (``linear_loss.ChunkOps``): (its raw logits
    x = hidden · weightᵀ fp32 ``[T, valid rounded up to even]``, m, s, u, label_logit), one kernel."""
    logits = torch.empty(hidden.shape[0], shard.valid + shard.valid % 2, dtype=torch.float32, device=hidden.device)
    stored = logits if shard.valid > 0 else None  # an all-padding shard has no logits
    return logits, *local_stats(hidden, weight, labels, shard, inv_tau, stored, mainloop)


def softmax_grad_stored(
    logits: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    inv_tau: float,
    lse: torch.Tensor,
    mean_z: torch.Tensor,
    g_logprob: torch.Tensor,
    g_entropy: torch.Tensor,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """dL/dx bf16 ``[T, valid]`` (a view with the logits' row stride) from the logits that
    :func:`logits_and_stats` stored, once the chunk's statistics and loss gradients are known.
    ``threshold`` as :func:`grads`'."""
    dz = torch.empty(logits.shape, dtype=torch.bfloat16, device=logits.device)
    vectors = [t.float().contiguous() for t in (lse, mean_z, g_logprob, g_entropy)]
    if shard.valid > 0:
        load_extension().softmax_grad_stored(
            logits, labels.long().contiguous(), shard.valid, shard.start, inv_tau, *vectors, dz, theta=_theta(threshold)
        )
    return dz[:, : shard.valid]


def _theta(threshold: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels' per-token truncation thresholds: contiguous fp32 ``[T]`` (units of z), or None."""
    return None if threshold is None else threshold.float().contiguous()


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
    mainloop: str | None = None,
    threshold: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dhidden [T,H] fp32, dweight [V_local,H] bf16), same contract as ``reference.grads_chunked``;
    ``mainloop`` as :func:`local_stats`. ``threshold`` ``[T]`` (truncation replay, in units of
    z = logits / temperature, global over the TP group): the kernel sets p = 0 where z < threshold,
    so ``lse`` and ``mean_z`` must be the truncated softmax's (``truncation.truncated_stats``).

    Extra memory: a bf16 dz chunk [T, chunk_vocab] and the fp32 dhidden accumulator.
    """
    ext = load_extension()
    wgmma = _wgmma(hidden.device, mainloop)
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
    theta = _theta(threshold)
    order = cta_group(hidden.shape[1])
    for v0 in range(0, shard.valid, chunk):
        v1 = min(v0 + chunk, shard.valid)
        ext.logprob_backward_dz(
            hidden,
            weight,
            labels,
            shard.valid,
            shard.start,
            inv_tau,
            *vectors,
            v0,
            v1 - v0,
            dz_buf,
            wgmma,
            theta=theta,
            cta_group=order,
        )
        dz = dz_buf[:, : v1 - v0]  # [T,vc]
        if d_weight is not None:
            torch.mm(dz.T, hidden, out=d_weight[v0:v1])
        if d_hidden is not None:
            _addmm_fp32(d_hidden, dz, weight[v0:v1])
    return d_hidden, d_weight
