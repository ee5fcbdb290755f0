"""The CUDA sources in csrc/ compile with nvcc for sm_80 and sm_90a (no GPU needed)."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

CSRC = Path(__file__).resolve().parents[2] / "csrc"
GENCODE = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a"]
# The flags torch's CUDAExtension passes, so that the sources build the same way under setup.py.
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]


SM90_KERNELS = ("logprob_forward_sm90_kernel", "logprob_backward_dz_sm90_kernel")
# the entry functions each is compiled to: the forward with and without the training path's store
SM90_ENTRIES = {"logprob_forward_sm90_kernel": 2, "logprob_backward_dz_sm90_kernel": 1}
CUDA_HOME = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")


def _nvcc() -> str:
    found = shutil.which("nvcc") or (str(CUDA_HOME / "bin/nvcc") if (CUDA_HOME / "bin/nvcc").exists() else None)
    if found is None:
        pytest.skip(f"nvcc not found (neither on PATH nor under {CUDA_HOME}/bin)")
    return found


def _cuda_include() -> Path:
    # nvcc on PATH may be a wrapper script, so ask the toolkit layout rather than nvcc's location
    for candidate in (CUDA_HOME / "include", Path(_nvcc()).resolve().parent.parent / "include"):
        if (candidate / "cuda_runtime_api.h").exists():
            return candidate
    pytest.skip(f"CUDA headers not found under {CUDA_HOME} (set CUDA_HOME)")


def _compile(source: str, out: Path, *flags: str) -> subprocess.CompletedProcess:
    includes = [f"-I{p}" for p in [str(CSRC), *include_paths()]]
    cmd = [
        _nvcc(),
        str(CSRC / source),
        "-o",
        str(out),
        "-O3",
        "-std=c++17",
        "--use_fast_math",
        *TORCH_NVCC_FLAGS,
        *includes,
        *flags,
    ]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cu")))
def test_cu_compiles_for_sm80_and_sm90a(source, tmp_path):
    """No errors, no warnings (ptxas warns when it serialises wgmma or ignores setmaxnreg), no spills."""
    proc = _compile(source, tmp_path / "out.o", "-c", "-Xptxas=-warn-spills", *GENCODE)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr
    assert "spill" not in proc.stderr, f"register spills:\n{proc.stderr}"
    assert (tmp_path / "out.o").stat().st_size > 0


def test_sm90a_build_uses_tma_and_wgmma(tmp_path):
    """The Hopper kernels really are on the Hopper path: TMA loads, wgmma, register reallocation
    between producer and consumers, and both kernels present."""
    proc = _compile("fused_logprob_sm90.cu", tmp_path / "k.ptx", "-ptx", "-gencode=arch=compute_90a,code=compute_90a")
    assert proc.returncode == 0, proc.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    for instruction in (
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
        "cp.async.bulk.tensor.2d",
        "mbarrier.try_wait.parity",
        "setmaxnreg.inc",
        "setmaxnreg.dec",
        "%globaltimer;",
        "trap;",
    ):  # the bounded mbarrier wait
        assert instruction in ptx, f"{instruction} missing from the sm_90a PTX"
    for kernel in ("logprob_forward_sm90_kernel", "logprob_backward_dz_sm90_kernel"):
        assert kernel in ptx
    # the sm_80 pass compiles the same kernels to a trap: none of the Hopper instructions
    proc = _compile("fused_logprob_sm90.cu", tmp_path / "k80.ptx", "-ptx", "-gencode=arch=compute_80,code=compute_80")
    assert proc.returncode == 0, proc.stderr
    assert "wgmma" not in (tmp_path / "k80.ptx").read_text()


def _entry_registers(ptxas_log: str) -> dict[str, list[int]]:
    """{kernel: [registers of each of its sm_90a entry functions]} in a ptxas -v log."""
    found, kernel = {}, None
    for line in ptxas_log.splitlines():
        entry = re.search(r"Compiling entry function '(\S+)' for 'sm_90a'", line)
        if entry:
            kernel = next((k for k in SM90_KERNELS if k in entry.group(1)), None)
        used = re.search(r"Used (\d+) registers", line)
        if used and kernel:
            found.setdefault(kernel, []).append(int(used.group(1)))
            kernel = None
    return found


def test_sm90a_kernels_get_the_registers_their_setmaxnreg_split_needs(tmp_path):
    """setmaxnreg moves registers between warpgroups within what the CTA got at launch: 168 per
    thread (kEntryRegs). ptxas choosing fewer would hang the consumers' setmaxnreg.inc; the host
    refuses the sm90 path then (sm90_mainloop_status), and this test fails first."""
    header = (CSRC / "tile_gemm_sm90.cuh").read_text()
    entry_regs = int(re.search(r"constexpr int kEntryRegs = (\d+);", header).group(1))
    assert entry_regs == 168  # 65536 registers / 384 threads, in ptxas's units of 8
    proc = _compile(
        "fused_logprob_sm90.cu", tmp_path / "k.o", "-c", "-Xptxas=-v", "-gencode=arch=compute_90a,code=sm_90a"
    )
    assert proc.returncode == 0, proc.stderr
    want = {k: [entry_regs] * n for k, n in SM90_ENTRIES.items()}
    assert _entry_registers(proc.stderr) == want, proc.stderr
    assert "C7507" not in proc.stderr and "C7510" not in proc.stderr, (
        proc.stderr
    )  # setmaxnreg kept, wgmma not serialised


def test_the_printf_time_out_report_builds(tmp_path):
    """MEGARL_MBAR_TIMEOUT_PRINTF, the debugging build whose timed-out waits print their place."""
    proc = _compile(
        "fused_logprob_sm90.cu",
        tmp_path / "k.ptx",
        "-ptx",
        "-DMEGARL_MBAR_TIMEOUT_PRINTF",
        "-gencode=arch=compute_90a,code=compute_90a",
    )
    assert proc.returncode == 0, proc.stderr
    assert "vprintf" in (tmp_path / "k.ptx").read_text()


@pytest.mark.parametrize("define, ticks", [(None, 4_000_000_000 >> 10), ("600000000000", 600_000_000_000 >> 10)])
def test_the_mbarrier_wait_bound_is_a_build_setting(tmp_path, define, ticks):
    """MEGARL_MBAR_TIMEOUT_NS (4 s unless defined; MEGARL_NVCC_FLAGS passes it) reaches the sm_90a
    code as its count of 1024-ns ticks, compared as a signed 32-bit difference."""
    flags = [] if define is None else [f"-DMEGARL_MBAR_TIMEOUT_NS={define}"]
    proc = _compile(
        "fused_logprob_sm90.cu", tmp_path / "k.ptx", "-ptx", *flags, "-gencode=arch=compute_90a,code=compute_90a"
    )
    assert proc.returncode == 0, proc.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    # the loop goes on while waited < ticks + 1, a signed comparison (a count set back never times out)
    assert re.search(rf"setp\.lt\.s32\s+%p\d+, %r\d+, {ticks + 1};", ptx), f"no signed comparison with {ticks} ticks"


def test_a_wait_bound_past_the_tick_range_is_refused(tmp_path):
    proc = _compile(
        "fused_logprob_sm90.cu",
        tmp_path / "k.ptx",
        "-ptx",
        "-DMEGARL_MBAR_TIMEOUT_NS=3000000000000",
        "-gencode=arch=compute_90a,code=compute_90a",
    )
    assert proc.returncode != 0 and "MEGARL_MBAR_TIMEOUT_NS must lie in" in proc.stderr


@pytest.mark.slow
def test_bindings_pass_a_syntax_check(tmp_path):
    """bindings.cpp against this torch's headers. A CPU wheel lacks one generated header of
    c10/cuda (cuda_cmake_macros.h); an empty stand-in is enough for a syntax check."""
    stub = tmp_path / "c10/cuda/impl/cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    includes = [tmp_path, CSRC, *include_paths(), _cuda_include(), sysconfig.get_paths()["include"]]
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    cmd = [
        cxx,
        "-std=c++17",
        "-fsyntax-only",
        "-DTORCH_EXTENSION_NAME=_C",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *[f"-I{p}" for p in includes],
        str(CSRC / "bindings.cpp"),
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
