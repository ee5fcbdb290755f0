"""Wheels for the GPU kit's actor step: megatron-core and its pure-Python needs, for a GPU node.

A GPU node without internet (Python 3.12, torch 2.11 cu130; see docs/guides/gpu-kit.md) may have
no megatron-core. This script downloads it for that interpreter and platform, plus the runtime
requirements its wheel declares (extras and environment markers evaluated for the target),
leaving out torch, triton and the nvidia-* CUDA libraries, which the machine's torch brings.
Each wheel is fetched with ``--no-deps``, so the set is exactly what is listed here. It prints
the sizes of the set and of the checkout; with ``--max-mib N`` (a limit of your own on what you
copy to the node) it exits non-zero, naming the largest wheel, when the two do not fit.

    python -m benchmarks.gpu_wheels .whl                       # for the GPU node (3.12)
    python -m benchmarks.gpu_wheels /tmp/w --python-version 3.11 --exclude numpy

On the machine: ``pip install --no-index --no-deps --target /tmp/site .whl/*.whl`` (the kit
does this, installing only the wheels whose package is not there already).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

VERSION_SET = Path(__file__).resolve().parents[1] / ".ci" / "constraints-gpu.txt"


def read_version_set(path: Path = VERSION_SET) -> dict[str, Requirement]:
    """The GPU version set (``.ci/constraints-gpu.txt``): canonical name -> requirement."""
    found = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            try:
                req = Requirement(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {line!r} is not a requirement: {exc}") from None
            found[canonicalize_name(req.name)] = req
    return found


def version_set_report(path: Path = VERSION_SET) -> list[str]:
    """One line per package of the set: the installed version against the set's, for the kit."""
    import importlib.metadata as md

    lines = []
    for name, req in read_version_set(path).items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            lines.append(f"{name}: not installed (set: {req.specifier})")
            continue
        verdict = "ok" if req.specifier.contains(have.split("+")[0], prereleases=True) else "differs"
        lines.append(f"{name}: {have} (set: {req.specifier}: {verdict})")
    return lines


MEGATRON_CORE = str(read_version_set()["megatron-core"])
PROVIDED = ("torch", "triton")  # with every nvidia-* package: the machine's torch has them
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def provided(name: str) -> bool:
    """Whether the target's torch already brings this distribution."""
    name = canonicalize_name(name)
    return name in PROVIDED or name.startswith("nvidia-")


def runtime_requirements(wheel: Path, python_version: str) -> list[Requirement]:
    """The Requires-Dist of a wheel that apply on Linux x86-64 under this Python, without extras."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    env = {
        **default_environment(),
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def _download(spec: str, dest: Path, python_version: str) -> Path:
    """pip download one wheel, no dependencies, for the target; the new wheel's path."""
    before = set(dest.glob("*.whl"))
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(dest),
        spec,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"pip download {spec} for Python {python_version} failed:\n{proc.stderr[-2000:]}")
    name = canonicalize_name(Requirement(spec).name)
    found = [w for w in dest.glob("*.whl") if parse_wheel_filename(w.name)[0] == name]
    new = [w for w in found if w not in before] or found
    return new[0]


def fetch(dest: Path, python_version: str, exclude: set[str], megatron_core: str = MEGATRON_CORE) -> list[Path]:
    """megatron-core and the closure of its runtime requirements, less torch & co and ``exclude``."""
    dest.mkdir(parents=True, exist_ok=True)
    exclude = {canonicalize_name(n) for n in exclude}
    wheels, todo, seen = [], [Requirement(megatron_core)], set()
    while todo:
        req = todo.pop(0)
        name = canonicalize_name(req.name)
        if name in seen or name in exclude or provided(name):
            continue
        seen.add(name)
        wheel = _download(f"{req.name}{req.specifier}", dest, python_version)
        wheels.append(wheel)
        todo += runtime_requirements(wheel, python_version)
    return wheels


def check_size(wheels: list[Path], tree_bytes: int, limit: int | None = None) -> str:
    """A line giving the sizes; raises SystemExit naming the overshoot when they exceed ``limit`` bytes."""
    total = sum(w.stat().st_size for w in wheels)
    line = (
        f"{len(wheels)} wheels, {total / 2**20:.1f} MiB; with the working tree ({tree_bytes / 2**20:.1f} MiB) "
        f"{(total + tree_bytes) / 2**20:.1f} MiB"
    )
    if limit is not None:
        line += f" of the {limit / 2**20:.0f} MiB limit (--max-mib)"
    if limit is not None and total + tree_bytes > limit:
        biggest = max(wheels, key=lambda w: w.stat().st_size)
        raise SystemExit(
            f"too large: {line}; the largest is {biggest.name} "
            f"({biggest.stat().st_size / 2**20:.1f} MiB): --exclude what the machine has"
        )
    return line


def working_tree_bytes(repo: Path) -> int:
    """Bytes of the checkout's files: tracked and untracked-not-ignored (what a copy to the node takes)."""
    proc = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        return 0
    files = (repo / f.decode() for f in proc.stdout.split(b"\0") if f)
    return sum(f.stat().st_size for f in files if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="where the wheels go (copy it to the node as .whl/)")
    parser.add_argument("--python-version", default="3.12", help="the target interpreter (default: 3.12)")
    parser.add_argument("--megatron-core", default=MEGATRON_CORE, help=f"requirement (default: {MEGATRON_CORE})")
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="NAME",
        help="a requirement the target has already (repeatable)",
    )
    parser.add_argument("--max-mib", type=float, help="refuse a set that, with the checkout, exceeds this many MiB")
    args = parser.parse_args(argv)
    wheels = fetch(args.outdir, args.python_version, set(args.exclude), args.megatron_core)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
    limit = None if args.max_mib is None else int(args.max_mib * 2**20)
    print(check_size(wheels, working_tree_bytes(Path(__file__).resolve().parents[1]), limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
