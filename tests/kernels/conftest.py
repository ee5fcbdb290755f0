"""The host emulator of the CUDA kernels (``tests/kernels/emulator``), shared by the tests that run
the kernels of ``csrc/`` on the CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EMULATOR = Path(__file__).resolve().parent / "emulator"
CUDA_HOME = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")


def mainloops_to_test() -> tuple[str, ...]:
    """The mainloops the GPU tests run: both, or only the one that an explicit
    ``MEGARL_CUDA_MAINLOOP=sm80`` (or ``sm90``) in the environment names, as the GPU kit's
    ``tests_sm80`` step sets it: the tests' own settings of the variable must not undo it."""
    forced = os.environ.get("MEGARL_CUDA_MAINLOOP", "auto")
    return (forced,) if forced in ("sm80", "sm90") else ("sm80", "sm90")


def _cuda_include() -> Path | None:
    """The CUDA toolkit's include dir (cuda_bf16.h and cuda_runtime_api.h compile for the host)."""
    nvcc = shutil.which("nvcc")
    candidates = [CUDA_HOME / "include"] + ([Path(nvcc).resolve().parent.parent / "include"] if nvcc else [])
    return next((c for c in candidates if (c / "cuda_bf16.h").exists() and (c / "cuda_runtime_api.h").exists()), None)


def build_emulator(exe: Path, *defines: str) -> Path:
    """The emulator driver with the kernels of csrc/ at ``exe`` (a few seconds); ``defines`` are
    extra -D flags, as an operator's MEGARL_NVCC_FLAGS would give them."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) to build the kernel emulator")
    include = _cuda_include()
    if include is None:
        pytest.skip(f"CUDA headers not found under {CUDA_HOME}/include nor next to nvcc (set CUDA_HOME)")
    cmd = [
        cxx,
        "-std=c++20",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Wno-unknown-pragmas",
        # the kernels type-pun device memory (bf16 pairs, fp32 reductions in a byte buffer)
        "-fno-strict-aliasing",
        # g++ notes that CUtensorMap (128-byte aligned) is passed by value since GCC 4.6's ABI
        "-Wno-psabi",
        "-DMEGARL_HOST_EMULATION",
        *defines,
        f"-I{ROOT / 'csrc'}",
        f"-I{EMULATOR}",
        f"-I{include}",
        str(EMULATOR / "run_kernels.cpp"),
        str(EMULATOR / "cuda_host_emu.cpp"),
        "-x",
        "c++",
        str(ROOT / "csrc/fused_logprob.cu"),
        str(ROOT / "csrc/fused_logprob_sm90.cu"),
        str(ROOT / "csrc/ppo_loss.cu"),
        str(ROOT / "csrc/softmax_grad.cu"),
        "-o",
        str(exe),
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return exe


@pytest.fixture(scope="session")
def run_kernels(tmp_path_factory) -> Path:
    """The emulator driver with the kernels of csrc/, built once per session."""
    return build_emulator(tmp_path_factory.mktemp("emulator") / "run_kernels")
