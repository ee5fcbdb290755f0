"""megarl's import layering, as ``docs/concepts/architecture.md`` states it, checked on every module.

Every ``import`` and ``from ... import`` of every file under ``megarl/`` counts: at module
level, inside functions and classes, and under ``if TYPE_CHECKING:`` (the last allowed only
where :data:`TYPE_CHECKING_ALLOWED` declares it). A *part* is a subpackage of ``megarl`` (or a
top-level module such as ``megarl/train.py``); :data:`FLOORS` lists the parts from the ground
up. A part imports parts on lower floors only: never a part on a higher floor, never another
part on its own floor. No files import each other in a loop either.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FLOORS: tuple[tuple[str, ...], ...] = (
    ("utils",),  # leaves: logging, stats tracking, heartbeat, network, processes, plug-in import, errors
    ("api",),  # contracts: engine and workflow interfaces, requests/responses, trajectories, rollout control
    ("kernels", "models"),  # fused-kernel entry points; HF <-> Megatron mapping and model building
    ("config",),  # the typed schema, its parsing and the checks that need nothing outside it
    ("data", "reward"),  # datasets and row formats; rewards and the reward process pool
    ("workflow",),  # rollout workflows (RLVR, multi-turn, grouped, agents)
    ("serving",),  # the inference servers: each backend's HTTP calls, the HTTP stack, ServerSet, launch
    ("actor", "bridge", "rollout"),  # the trainer; weight resharding; the asyncio rollout side
    ("run",),  # run-level services: pre-launch checks, the weight-sync phase, saver, recover, stats
    ("plan", "train"),  # the allocation planner; the trainer script
    ("launcher",),  # megarl's CLI, local and Slurm launchers, the watchdog
)
"""Parts from the ground floor up (the table of ``docs/concepts/architecture.md``)."""
EXTERNAL = ("megarl._C",)
"""Names under ``megarl`` that are no source file (the compiled CUDA extension)."""
TYPE_CHECKING_ALLOWED: set[tuple[str, str]] = {
    # a workflow's episode receives the engine it generates with, and the engine runs workflows
    ("megarl/api/workflow_api.py", "megarl.api.engine_api"),
    # the cross-section checks take the experiment config that runs them
    ("megarl/config/checks.py", "megarl.config.experiment"),
}
"""(file, imported module) pairs allowed under ``if TYPE_CHECKING:`` against the floors, or
closing a loop of files (a loop of type annotations only, which never runs)."""
MOVED: dict[str, str] = {
    "megarl/bridge/update.py": "megarl.run.weight_sync",
    "megarl/utils/saver.py": "megarl.run.saver",
    "megarl/utils/evaluator.py": "megarl.run.evaluator",
    "megarl/utils/stats_logger.py": "megarl.run.stats_logger",
    "megarl/rollout/server.py": "megarl.serving.launch",
    "megarl/rollout/servers.py": "megarl.serving.servers",
}
"""Old paths of moved documented modules (``megarl.utils.deprecation``): each shim imports its new
module, whatever its floor, and nothing else of megarl imports a shim; the shims stand outside the
floors. Only a path that was documented keeps a shim (``docs/name-mapping.md``, "Moved paths")."""


@dataclass(frozen=True)
class Import:
    file: str
    line: int
    module: str
    type_checking: bool


class Tree:
    """The ``megarl`` package under ``root``: its modules and every import they make."""

    def __init__(self, root: Path):
        self.root = root
        self.modules = {self.module_of(path): path for path in sorted((root / "megarl").rglob("*.py"))}
        self.imports = [imp for path in self.modules.values() for imp in self._imports_of(path)]

    def module_of(self, path: Path) -> str:
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join(parts)

    def resolve(self, name: str) -> str | None:
        """The source module an imported name lives in (``megarl.a.b.name`` -> ``megarl.a.b``), or None."""
        while name:
            if name in self.modules:
                return name
            name = name.rpartition(".")[0]
        return None

    def _imports_of(self, path: Path) -> list[Import]:
        module, is_package = self.module_of(path), path.name == "__init__.py"
        rel = str(path.relative_to(self.root))
        found: list[Import] = []

        def visit(node: ast.AST, type_checking: bool) -> None:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.body:
                    visit(child, True)
                for child in node.orelse:
                    visit(child, type_checking)
                return
            for name in _imported_names(node, module, is_package):
                if name == "megarl" or name.startswith("megarl."):
                    found.append(Import(rel, node.lineno, name, type_checking))
            for child in ast.iter_child_nodes(node):
                visit(child, type_checking)

        visit(ast.parse(path.read_text(), filename=str(path)), False)
        return found

    def _allowed(self, imp: Import, target: str) -> bool:
        if MOVED.get(imp.file) == target or (imp.file in MOVED and target == "megarl.utils.deprecation"):
            return True  # an old path forwarding to the new one
        return imp.type_checking and (imp.file, target) in TYPE_CHECKING_ALLOWED

    def targets(self) -> dict[tuple[str, int, str], tuple[Import, str]]:
        """(file, line, imported part) -> (the import, the most specific module it names there):
        ``from megarl.config import c`` names ``megarl.config`` and ``megarl.config.c``, one import."""
        found: dict[tuple[str, int, str], tuple[Import, str]] = {}
        for imp in self.imports:
            target = None if imp.module.startswith(EXTERNAL) else self.resolve(imp.module)
            if target is None or target == "megarl":
                continue
            key = (imp.file, imp.line, part_of(target))
            if key not in found or len(target) > len(found[key][1]):
                found[key] = (imp, target)
        return found

    def violations(self) -> list[str]:
        """One line per import against the floors: file, line, both parts and why."""
        problems = []
        for imp, target in self.targets().values():
            src, dst = part_of(self.module_of(self.root / imp.file)), part_of(target)
            if src in (dst, "megarl") or self._allowed(imp, target):
                continue
            src_floor, dst_floor = floor_of(src), floor_of(dst)
            where = f"{imp.file}:{imp.line}"
            if src_floor is None or dst_floor is None:
                problem = f"{where}: {src} or {dst} is on no floor of tests/test_layering.py FLOORS"
            elif dst_floor > src_floor:
                problem = (
                    f"{where}: {src} (floor {src_floor + 1}) imports {target} ({dst}, floor {dst_floor + 1}): runs up"
                )
            elif dst_floor == src_floor:
                problem = f"{where}: {src} imports {target}: {src} and {dst} share floor {src_floor + 1}"
            else:
                continue
            problems.append(problem)
        return problems

    def cycles(self) -> list[list[str]]:
        """Loops of files importing each other (any import at any level), each as its sorted files."""
        graph: dict[str, set[str]] = {m: set() for m in self.modules}
        for imp in self.imports:
            target, src = self.resolve(imp.module), self.module_of(self.root / imp.file)
            # a package's own __init__ handing on names from its modules is no loop
            if target and target != src and not src.startswith(target + ".") and not self._allowed(imp, target):
                graph[src].add(target)
        return strongly_connected(graph)


def part_of(module: str) -> str:
    """``megarl.rollout.pool`` -> ``rollout``; ``megarl.train`` -> ``train``; ``megarl`` -> ``megarl``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floor_of(part: str) -> int | None:
    return next((i for i, parts in enumerate(FLOORS) if part in parts), None)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Absolute module names ``node`` imports (``from m import x`` gives ``m`` and ``m.x``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while component[-1:] != [node]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@functools.cache
def megarl_tree() -> Tree:
    return Tree(REPO)


def test_every_part_is_on_a_floor():
    parts = {part_of(m) for m in megarl_tree().modules} - {"megarl"}
    assert not parts - {p for floor in FLOORS for p in floor}, "add them to FLOORS and to the architecture page"


def test_imports_follow_the_floors():
    problems = megarl_tree().violations()
    assert not problems, f"{len(problems)} imports against the layering:\n" + "\n".join(problems)


def test_no_files_import_each_other_in_a_loop():
    cycles = megarl_tree().cycles()
    assert not cycles, "import loops:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_nothing_in_megarl_imports_an_old_path_and_each_shim_forwards_only():
    tree = megarl_tree()
    shims = {tree.module_of(REPO / f) for f in MOVED}
    users = [f"{imp.file}:{imp.line} imports {imp.module}" for imp in tree.imports if tree.resolve(imp.module) in shims]
    assert users == [], "megarl's own code imports from its new paths"
    for file, new in MOVED.items():
        imported = {tree.resolve(imp.module) for imp in tree.imports if imp.file == file}
        assert imported == {new, "megarl.utils.deprecation"}, f"{file} imports {imported}, not just {new}"


def test_the_architecture_page_lists_the_floors():
    page = (REPO / "docs" / "concepts" / "architecture.md").read_text()
    for number, parts in enumerate(FLOORS, start=1):
        row = f"| {number} | " + ", ".join(f"`{p}`" for p in parts) + " |"
        assert row in page, f"docs/concepts/architecture.md lacks the floor row {row!r}"


# -- the checker itself, on small trees ---------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Tree:
    for name, text in files.items():
        path = tmp_path / "megarl" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in {p.parent for p in (tmp_path / "megarl").rglob("*.py")}:
        (folder / "__init__.py").touch()
    return Tree(tmp_path)


def test_an_import_inside_a_function_that_runs_up_is_named_with_its_line(tmp_path):
    tree = _tree(
        tmp_path,
        {
            "utils/a.py": "import os\n\n\ndef f():\n    from megarl.actor.engine import X\n",
            "actor/engine.py": "X = 1\n",
        },
    )
    assert tree.violations() == [
        "megarl/utils/a.py:5: utils (floor 1) imports megarl.actor.engine (actor, floor 8): runs up"
    ]


def test_parts_on_one_floor_may_not_import_each_other(tmp_path):
    tree = _tree(tmp_path, {"actor/a.py": "from megarl.rollout import b\n", "rollout/b.py": ""})
    assert tree.violations() == ["megarl/actor/a.py:1: actor imports megarl.rollout.b: actor and rollout share floor 8"]


def test_type_checking_imports_count_unless_declared(tmp_path):
    text = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megarl.config import c\n"
    tree = _tree(tmp_path, {"models/m.py": text, "config/c.py": ""})
    assert len(tree.violations()) == 1 and "runs up" in tree.violations()[0]


def test_relative_imports_and_loops_between_files(tmp_path):
    tree = _tree(tmp_path, {"run/a.py": "from . import b\n", "run/b.py": "from .a import x\n"})
    assert tree.violations() == []
    assert tree.cycles() == [["megarl.run.a", "megarl.run.b"]]
