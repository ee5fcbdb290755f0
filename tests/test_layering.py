"""megarl's import layering, as ``docs/concepts/architecture.md`` states it, checked on every module.

Every ``import`` and ``from ... import`` of every file under ``megarl/`` counts: at module
level, inside functions and classes, and under ``if TYPE_CHECKING:`` (the last allowed only
where :data:`TYPE_CHECKING_ALLOWED` declares it). A *unit* is a subpackage of ``megarl`` (or a
top-level module such as ``megarl/train.py``); :data:`FLOORS` lists the units from the ground
up. A unit may import units on lower floors only: never a unit on a higher floor, never another
unit on its own floor. No two files may import each other in a loop either.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megarl"

FLOORS: tuple[tuple[str, ...], ...] = (
    ("utils",),  # leaves: logging, stats tracking, heartbeat, network, processes, plug-in import
    ("api",),  # contracts: engine and workflow interfaces, request/response types, trajectories
    ("kernels", "models"),  # fused-kernel entry points; HF <-> Megatron mapping and model building
    ("config",),  # the typed schema, its parsing and the checks that need nothing outside it
    ("data", "reward"),  # datasets and row formats; rewards and the reward process pool
    ("workflow",),  # rollout workflows (RLVR, multi-turn, grouped, agents)
    ("actor", "bridge", "rollout"),  # the Megatron trainer; weight resharding to the servers; the
    # asyncio rollout side. They never import each other: they meet in `run` and `train`.
    ("run",),  # run-level services: pre-launch checks, weight sync phase, saver, recover, evaluator, stats
    ("plan", "train"),  # the allocation planner; the trainer script
    ("launcher",),  # megarl's CLI, local / Slurm / MPI launchers, the watchdog
)
"""Units from the ground floor up."""
EXTERNAL = {"megarl._C"}
"""Names under ``megarl`` that are no source file (the compiled CUDA extension)."""
TYPE_CHECKING_ALLOWED: set[tuple[str, str]] = {
    # a workflow's episode takes the engine it generates with, and the engine runs workflows
    ("megarl/api/workflow_api.py", "megarl.api.engine_api"),
}
"""(file, imported module) pairs allowed under ``if TYPE_CHECKING:``: against the floors, or
closing a loop of files (a loop of type annotations only, which never runs)."""


@dataclass(frozen=True)
class Import:
    file: str
    line: int
    module: str
    type_checking: bool

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def unit_of(module: str) -> str:
    """``megarl.rollout.pool`` -> ``rollout``; ``megarl.train`` -> ``train``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_of(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(path: Path) -> list[Import]:
    module = module_of(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [_absolute(node, module, is_package)]
            names += [f"{names[0]}.{alias.name}" for alias in node.names]  # `from megarl import x`
        else:
            names = []
        for name in names:
            if name == "megarl" or name.startswith("megarl."):
                found.append(Import(str(path.relative_to(REPO)), node.lineno, name, type_checking))
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(tree, False)
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def source_modules() -> dict[str, Path]:
    return {module_of(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str | None:
    """The source module an imported name lives in (``megarl.a.b.name`` -> ``megarl.a.b``), or None."""
    modules = source_modules()
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


@functools.cache
def all_imports() -> list[Import]:
    return [imp for path in source_modules().values() for imp in _imports_of(path)]


def floor_of(unit: str) -> int | None:
    return next((i for i, units in enumerate(FLOORS) if unit in units), None)


def layering_violations() -> list[str]:
    problems: dict[str, None] = {}  # ordered, one line per file, line and target
    for imp in all_imports():
        if imp.module in EXTERNAL or any(imp.module.startswith(e + ".") for e in EXTERNAL):
            continue
        target = resolve(imp.module)
        if target is None or target == "megarl":
            continue
        src, dst = unit_of(module_of(REPO / imp.file)), unit_of(target)
        if src == dst or src == "megarl":
            continue
        if imp.type_checking and (imp.file, target) in TYPE_CHECKING_ALLOWED:
            continue
        src_floor, dst_floor = floor_of(src), floor_of(dst)
        if src_floor is None or dst_floor is None:
            problems[f"{imp.where}: {src} or {dst} is on no floor of tests/test_layering.py FLOORS"] = None
        elif dst_floor > src_floor:
            problems[f"{imp.where}: {src} (floor {src_floor}) imports {target} ({dst}, floor {dst_floor}): runs up"] = None
        elif dst_floor == src_floor:
            problems[f"{imp.where}: {src} imports {target}: {src} and {dst} share floor {src_floor}"] = None
    return list(problems)


def file_cycles() -> list[list[str]]:
    """Loops of files importing each other (any import, at any level), each as its files in order."""
    graph: dict[str, set[str]] = {m: set() for m in source_modules()}
    for imp in all_imports():
        target = resolve(imp.module)
        if imp.type_checking and (imp.file, target) in TYPE_CHECKING_ALLOWED:
            continue
        src = module_of(REPO / imp.file)
        if target and target != src and not _is_package_face(target, src):
            graph[src].add(target)
    return _cycles(graph)


def _is_package_face(target: str, src: str) -> bool:
    """``megarl.x`` imported from inside ``megarl.x``: the package's own ``__init__`` re-exporting."""
    return src.startswith(target + ".")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                strong(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strong(node)
    return found


def test_every_unit_is_on_a_floor():
    units = {unit_of(m) for m in source_modules()} - {"megarl"}
    assert not units - {u for floor in FLOORS for u in floor}, "add these to FLOORS and to the architecture page"


def test_imports_follow_the_floors():
    problems = layering_violations()
    assert not problems, f"{len(problems)} imports against the layering:\n" + "\n".join(problems)


def test_no_files_import_each_other_in_a_loop():
    cycles = file_cycles()
    assert not cycles, "import loops:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    ("source", "want"),
    [
        ("from megarl.rollout.pool import RolloutPool", "megarl.rollout.pool"),
        ("from megarl import train", "megarl.train"),
        ("import megarl.utils.heartbeat as hb", "megarl.utils.heartbeat"),
    ],
)
def test_checker_resolves_imports(tmp_path, source, want):
    names = [n for n in (ast.parse(source).body[0].__dict__.get("module"),) if n]
    node = ast.parse(source).body[0]
    name = node.names[0].name if isinstance(node, ast.Import) else f"{node.module}.{node.names[0].name}"
    assert resolve(name) == want or resolve(names[0] if names else name) == want
