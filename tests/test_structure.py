"""Size and formatting rules of ``megarl/`` that ``docs/concepts/architecture.md`` and the development page state."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 300
"""The most lines a class of the package spans (its docstring and methods included)."""
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


def test_no_class_of_the_package_is_over_300_lines():
    long = {}
    for path in python_files("megarl"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert not long, f"classes over {MAX_CLASS_LINES} lines (give a responsibility a class of its own): {long}"


def test_fmt_skip_only_with_a_reason():
    bare = []
    for path in python_files("megarl", "tests", "benchmarks", "examples", "launch"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = FMT_SKIP.search(line)
            if match and not match["rest"].strip().lstrip("#").strip():
                bare.append(f"{path.relative_to(REPO)}:{number}")
    assert not bare, f"'# fmt: skip' without a comment saying why: {bare}"


SERVER_ROUTES = {
    "vllm": (
        "/v1/completions",
        "/v1/models",
        "/pause",
        "/resume",
        "/sleep",
        "/wake_up",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/megarl/update_weights",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/metrics",
    ),
    "sglang": (
        "/generate",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/init_weights_update_group",
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    ),
}
"""Every route megarl calls on a server family (``/health`` aside: every family's and megarl's own)."""


def _strings(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_each_server_familys_routes_are_called_from_its_one_file():
    """What megarl says to a vLLM (SGLang) server is read in one file: ``megarl/serving/vllm.py`` (``sglang.py``)."""
    elsewhere = {}
    for path in python_files("megarl"):
        rel = str(path.relative_to(REPO))
        for family, routes in SERVER_ROUTES.items():
            found = sorted(_strings(path) & set(routes))
            if found and rel != f"megarl/serving/{family}.py":
                elsewhere[(rel, family)] = found
    assert not elsewhere, f"server routes outside their family's file in megarl/serving/: {elsewhere}"


def test_only_the_server_set_keeps_servers_out_of_rotation():
    """No module but ``megarl/serving/servers.py`` keeps its own record of unhealthy servers (an attribute or
    variable named ``unhealthy``, ``*_unhealthy``, ``unhealthy_servers``): the weight sync asks the run's
    ``ServerSet``."""
    found = []
    for path in python_files("megarl"):
        rel = str(path.relative_to(REPO))
        if rel == "megarl/serving/servers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) else []:
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if re.fullmatch(r"_?unhealthy(_servers)?|.*_unhealthy", name or ""):
                    found.append(f"{rel}:{node.lineno} {name}")
    assert not found, f"a second record of unhealthy servers: {found}"


def _layout_block() -> list[str]:
    """The code block under the architecture page's ``## Layout`` heading."""
    page = (REPO / "docs" / "concepts" / "architecture.md").read_text()
    section = page[page.index("## Layout") :]
    return section[section.index("```\n") + 4 : section.index("\n```", section.index("```\n") + 4)].splitlines()


def test_the_architecture_pages_layout_block_matches_the_tree():
    """Every part of the package (subpackage or top-level module) is in the Layout block once, the block
    names nothing that is not there, and each top-level folder it names exists; the tests mirror the
    package: a ``tests/<part>/`` per subpackage."""
    lines = _layout_block()
    listed = [m.group(1) for line in lines if (m := re.match(r"^  (\w+(?:/|\.py))\s", line))]
    parts = sorted(
        [f"{p.name}/" for p in (REPO / "megarl").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
        + [p.name for p in (REPO / "megarl").glob("*.py") if p.name != "__init__.py"]
    )
    assert sorted(listed) == parts, f"the Layout block lists {sorted(listed)}, the package has {parts}"
    top = [m.group(1) for line in lines if (m := re.match(r"^(\w+/)\s", line))]
    assert [t for t in top if not (REPO / t).is_dir()] == [], top
    missing = [p for p in parts if p.endswith("/") and not (REPO / "tests" / p).is_dir()]
    assert missing == [], f"tests/ does not mirror megarl/: no tests/ folder for {missing}"
