"""A regular (non-editable) install ships the CUDA sources, so the JIT build works from any install.

pip builds a project in an isolated environment without torch, where setup.py cannot compile
``csrc/``; the wheel must then carry the sources as ``megarl/_csrc`` and ``megarl.kernels`` must
find them there. The wheel is built the way ``pip install .`` builds it (build isolation on, from
a copy of the tracked files) and installed into a fresh venv, which borrows this interpreter's
torch through a path entry (not its site directory: the editable install's finder stays out).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from megarl.kernels import _cuda

ROOT = Path(__file__).resolve().parent.parent


def _tracked_copy(dest: Path) -> Path:
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / name.decode()
        if source.is_file():
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return dest


def _run(*cmd, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # megarl must come from the wheel
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_an_editable_install_finds_the_sources_in_the_checkout():
    assert _cuda.kernel_sources() == _cuda.CSRC
    assert "JIT-built from" in _cuda.build_origin() and str(_cuda.CSRC) in _cuda.build_origin()


def test_a_wheel_built_without_torch_ships_the_cuda_sources_and_finds_them(tmp_path):
    src = _tracked_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src), cwd=tmp_path)
    (wheel,) = dist.glob("megarl-*.whl")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv), cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)
    site = Path(
        _run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip()
    )
    (site / "borrowed_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = _run(
        str(python),
        "-c",
        "import megarl; from megarl.kernels import _cuda; "
        "print(megarl.__file__); print(_cuda.kernel_sources()); print(_cuda.build_origin())",
        cwd=tmp_path,
    ).splitlines()
    assert out[0] == str(site / "megarl" / "__init__.py"), "megarl did not come from the wheel"
    packaged = site / "megarl" / "_csrc"
    assert out[1] == str(packaged)
    assert sorted(p.name for p in packaged.iterdir() if p.suffix != ".md") == sorted(
        p.name for p in _cuda.CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp")
    )
    assert out[2].startswith(f"JIT-built from {packaged}") and "--no-build-isolation" in out[2]


@pytest.mark.parametrize("name", ["MANIFEST.in"])
def test_a_source_distribution_carries_the_cuda_sources(name):
    text = (ROOT / name).read_text()
    assert "recursive-include csrc" in text and ".cu" in text and ".cuh" in text
