"""benchmarks/gpu_wheels.py: which wheels the GPU kit's actor step gets, and that they install offline."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from benchmarks import gpu_wheels

REPO = Path(__file__).resolve().parents[2]


def _wheel(path: Path, *requires: str) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        meta = "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
        zf.writestr("demo-1.0.dist-info/METADATA", meta)
    return path


def test_runtime_requirements_drop_extras_and_other_platforms(tmp_path):
    wheel = _wheel(
        tmp_path / "demo-1.0-py3-none-any.whl",
        "torch>=2.6.0",
        "numpy",
        "packaging>=24.2",
        'wandb; extra == "mlm"',
        'pywin32; sys_platform == "win32"',
        'tomli; python_version < "3.11"',
    )
    names = lambda v: [r.name for r in gpu_wheels.runtime_requirements(wheel, v)]
    assert names("3.12") == ["torch", "numpy", "packaging"]
    assert names("3.10") == ["torch", "numpy", "packaging", "tomli"]


def test_torch_and_its_cuda_libraries_are_left_to_the_machine():
    assert all(gpu_wheels.provided(n) for n in ("torch", "Triton", "nvidia-cublas", "nvidia_nccl_cu13"))
    assert not any(gpu_wheels.provided(n) for n in ("numpy", "megatron-core", "packaging"))


def test_a_set_over_the_size_limit_is_refused_naming_the_largest(tmp_path):
    small, big = tmp_path / "a.whl", tmp_path / "big-1.0-py3-none-any.whl"
    small.write_bytes(b"x" * 1000)
    big.write_bytes(b"x" * 3000)
    assert "2 wheels" in gpu_wheels.check_size([small, big], tree_bytes=0, limit=5000)
    assert "limit" not in gpu_wheels.check_size([small, big], tree_bytes=10**9), "no limit unless --max-mib"
    with pytest.raises(SystemExit, match=r"too large: .* the largest is big-1.0-py3-none-any.whl"):
        gpu_wheels.check_size([small, big], tree_bytes=2000, limit=5000)


@pytest.mark.slow
def test_the_set_installs_offline_beside_this_torch(tmp_path):
    """Fetched for this interpreter (a GPU node's 3.12 is not installable here beside a
    torch: this machine has a torch wheel for 3.11 only), installed with the kit's command (no
    index, no deps, --target), then megatron.core imports from there with the running torch."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheels = gpu_wheels.fetch(tmp_path / "whl", version, exclude=set())
    names = {canonicalize_name(w.name.split("-")[0]) for w in wheels}
    assert names == {"megatron-core", "numpy", "packaging"}  # torch & co are the machine's
    site = tmp_path / "site"
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--target",
        str(site),
        *map(str, wheels),
    ]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    probe = "import megatron.core, torch; from megatron.core.transformer import TransformerConfig; print(megatron.core.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", probe], check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(site))
