"""Size and formatting rules of ``megarl/`` that ``docs/concepts/architecture.md`` and the development page state."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 600
MAX_CLASS_LINES = {
    ("megarl/rollout/pool.py", "RolloutPool"): 400,
    ("megarl/rollout/engine.py", "RemoteInferenceEngine"): 400,
    ("megarl/actor/engine.py", "MegatronEngine"): 400,
}
"""Classes kept small on purpose: (file, class) -> most lines."""
FMT_SKIP = re.compile(r"#\s*fmt:\s*skip\b(?P<rest>.*)$")


def python_files(*parts: str) -> list[Path]:
    return sorted(p for part in parts for p in (REPO / part).rglob("*.py") if ".venv" not in p.parts)


def test_no_file_of_the_package_is_over_600_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in python_files("megarl")
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines (split them along a responsibility): {long}"


def test_the_rollout_pool_and_the_engine_classes_stay_small():
    for (file, name), most in MAX_CLASS_LINES.items():
        tree = ast.parse((REPO / file).read_text())
        (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
        lines = cls.end_lineno - cls.lineno + 1
        assert lines < most, f"{file}: class {name} is {lines} lines (fewer than {most} wanted)"


def test_fmt_skip_only_with_a_reason():
    bare = []
    for path in python_files("megarl", "tests", "benchmarks", "examples", "launch"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = FMT_SKIP.search(line)
            if match and not match["rest"].strip().lstrip("#").strip():
                bare.append(f"{path.relative_to(REPO)}:{number}")
    assert not bare, f"'# fmt: skip' without a comment saying why: {bare}"
