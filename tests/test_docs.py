"""The docs name only what exists: every page of ``docs/`` and the README, read as a user would.

What counts as a name, in inline code or in a fenced code block's command lines:

* a config key: ``a.b.c`` whose first part is a field of :class:`~megarl.config.GRPOConfig`,
  or ``key=value`` (one or several, space-separated) whose key starts with one; checked against
  the dataclass tree (AReaL's aliases accepted; any sub-key of a ``dict`` field such as
  ``workflow.kwargs``);
* a command: ``megarl SUB --flag ... key=value`` (subcommand and flags against the CLI's
  argparse, overrides as keys), a bare ``--flag`` (some subcommand must take it),
  ``make TARGET`` (against the Makefile), ``python -m MODULE``;
* a repository path: a token starting with ``configs/``, ``megarl/``, ``benchmarks/``,
  ``tests/``, ``launch/``, ``examples/``, ``docs/``, ``csrc/`` or ``.ci/`` (``::name``
  suffixes, globs; tokens with ``{``, ``<`` or ``NAME``-style placeholders are skipped);
* a Python path ``megarl.x.y`` / ``examples.x.Y`` / ``benchmarks.x``: module file, then the name
  defined in it;
* a relative Markdown link: the file it points to (``tests/test_doc_links.py`` checks anchors too).

Names of other projects go in a table column headed AReaL, verl or TRL; those cells are not
checked. The site itself builds with ``mkdocs build --strict`` (``make docs``), which also checks
anchors and the API objects.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import re
import shlex
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATH_PREFIXES = ("configs/", "megarl/", "benchmarks/", "tests/", "launch/", "examples/", "docs/", "csrc/", ".ci/")
PY_ROOTS = ("megarl", "examples", "benchmarks", "tests")
FOREIGN_COLUMN = re.compile(r"\b(areal|verl|trl)\b", re.IGNORECASE)
DOTTED = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z0-9_]+)+$")
OVERRIDE = re.compile(r"^([A-Za-z_][\w.]*)=(.*)$", re.DOTALL)
PY_PATH = re.compile(r"^(" + "|".join(PY_ROOTS) + r")(\.[A-Za-z_]\w*)+$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*(```|~~~)")
# `launcher.log`, `watchdog.jsonl`: file names, not keys (no config key ends in one of these)
FILE_SUFFIX = re.compile(r"\.(log|jsonl|json|ya?ml|md|py|html|png|txt|safetensors|sbatch|gguf|parquet)$")


def doc_files() -> list[Path]:
    return sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]


# -- what exists ----------------------------------------------------------------------------------


def _dataclass_of(tp):
    if dataclasses.is_dataclass(tp):
        return tp
    return next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)


def _is_dict(tp) -> bool:
    return tp is dict or typing.get_origin(tp) is dict or any(_is_dict(a) for a in typing.get_args(tp))


@functools.cache
def config_keys() -> tuple[frozenset[str], frozenset[str]]:
    """Every key of the config tree, and the keys under which any sub-key is valid (dict fields)."""
    from megarl.config import GRPOConfig
    from megarl.config.loader import AREAL_ALIASES

    keys, open_keys = set(AREAL_ALIASES), set()

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            key, tp = prefix + field.name, hints[field.name]
            keys.add(key)
            if (sub := _dataclass_of(tp)) is not None:
                walk(sub, key + ".")
            elif _is_dict(tp):
                open_keys.add(key)

    walk(GRPOConfig, "")
    return frozenset(keys), frozenset(open_keys)


def top_level_fields() -> set[str]:
    return {key for key in config_keys()[0] if "." not in key}


def key_exists(key: str) -> bool:
    keys, open_keys = config_keys()
    return key in keys or any(key.startswith(k + ".") for k in open_keys)


@functools.cache
def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    from megarl.launcher.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


@functools.cache
def make_targets(makefile: Path = REPO / "Makefile") -> frozenset[str]:
    targets = set()
    for line in makefile.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.$()/-][^:=#\s]*(?:\s+[^:=#\s]+)*)\s*:(?!=)", line)
        if m and not line.startswith((".PHONY", "\t")):
            targets.update(m.group(1).split())
    return frozenset(targets)


@functools.cache
def _module_names(path: Path) -> dict[str, set[str]]:
    """Top-level names a module defines or imports, and each top-level class's own names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[""].add(node.name)
            if isinstance(node, ast.ClassDef):
                names[node.name] = {n.name for n in node.body if hasattr(n, "name")} | {
                    t.id
                    for n in node.body
                    if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    if isinstance(t, ast.Name)
                }
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names[""].update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names[""].update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def python_path_problem(dotted: str, repo: Path = REPO) -> str | None:
    """None when ``dotted`` is a module of the repository, or a name defined in one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = repo.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[i:]
            if not rest:
                return None
            names = _module_names(module)
            if rest[0] not in names[""] and not (base / f"{rest[0]}.py").is_file():
                return f"Python name {dotted!r}: {rest[0]!r} is not defined in {module.relative_to(repo)}"
            if len(rest) > 1 and rest[0] in names and rest[1] not in names[rest[0]]:
                return f"Python name {dotted!r}: class {rest[0]} has no {rest[1]!r}"
            return None
        if base.is_dir() and i == len(parts):
            return None  # a namespace directory
    return f"Python module {dotted!r} does not exist"


def path_problem(token: str, repo: Path = REPO) -> str | None:
    """None when a repository path exists (a glob matches, a ``file::test`` names a function)."""
    path, _, name = token.partition("::")
    if any(c in path for c in "*?["):
        return None if list(repo.glob(path)) else f"no file matches {path!r}"
    if not (repo / path).exists():
        return f"path {path!r} does not exist"
    if name and not re.search(
        rf"^\s*(async\s+)?def {re.escape(name.split('[')[0])}\b", (repo / path).read_text(), re.MULTILINE
    ):
        return f"{path} has no function {name!r}"
    return None


# -- reading a page -------------------------------------------------------------------------------


def _is_placeholder(token: str) -> bool:
    if token in ("key", "key.path"):  # `key=value`, `key.path=value`: the syntax, not a key
        return True
    return any(c in token for c in "{}<>") or bool(re.search(r"(^|/)[A-Z][A-Z_]+(\.|/|$)", token))


def _clean(token: str) -> str:
    return token.strip("'\"`,;()").rstrip(".:")


def _check_override(token: str, problems: list[str], strict: bool) -> None:
    m = OVERRIDE.match(token)
    if not m or _is_placeholder(m.group(1)):
        return
    key = m.group(1)
    if (strict or key.split(".")[0] in top_level_fields()) and not key_exists(key):
        problems.append(f"config key {key!r} (in {token!r}) does not exist")


def check_command(line: str, problems: list[str]) -> None:
    """A shell line: megarl / make / python -m commands, overrides and paths in it."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        tokens = line.split()
    modules = [tokens[i + 1] for i, token in enumerate(tokens[:-1]) if token == "-m"]
    problems += [p for m in modules if m.split(".")[0] in PY_ROOTS and (p := python_path_problem(m))]
    for token in tokens:
        clean = _clean(token)
        if clean.startswith(PATH_PREFIXES) and not _is_placeholder(clean) and (p := path_problem(clean)):
            problems.append(p)
    if len(tokens) >= 2 and tokens[0] == "megarl" and re.fullmatch(r"[a-z]+", tokens[1]):
        parsers = cli_parsers()
        if tokens[1] not in parsers:
            problems.append(f"megarl has no subcommand {tokens[1]!r} (in {line.strip()!r})")
            return
        flags = _flags(parsers[tokens[1]])
        for token in tokens[2:]:
            if token.startswith("--") and token.split("=")[0] not in flags:
                problems.append(f"'megarl {tokens[1]}' has no flag {token.split('=')[0]!r}")
            _check_override(token, problems, strict=True)
    elif tokens and tokens[0] == "make":
        for token in tokens[1:]:
            if m := OVERRIDE.match(token):
                if m.group(1) == "RUN_ARGS":
                    for override in shlex.split(m.group(2)):
                        _check_override(override, problems, strict=True)
            elif not token.startswith("-") and token not in make_targets():
                problems.append(f"make target {token!r} does not exist (Makefile)")
    else:
        for token in tokens:
            _check_override(token, problems, strict=False)


def check_span(span: str, problems: list[str]) -> None:
    """One inline code span."""
    span = span.strip()
    if " " in span or span.startswith(("megarl ", "make ")):
        check_command(span, problems)
        return
    if re.fullmatch(r"--[a-z][a-z-]*", span):
        if not any(span in _flags(p) for p in cli_parsers().values()):
            problems.append(f"no megarl subcommand takes {span!r}")
    elif OVERRIDE.match(span):
        _check_override(span, problems, strict=False)
    elif DOTTED.match(span) and span.split(".")[0] in top_level_fields() and not FILE_SUFFIX.search(span):
        if not key_exists(span):
            problems.append(f"config key {span!r} does not exist")
    elif PY_PATH.match(span):
        if (p := python_path_problem(span)) is not None:
            problems.append(p)
    elif span.startswith(PATH_PREFIXES) and not _is_placeholder(span) and (p := path_problem(_clean(span))):
        problems.append(p)


def _table_cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _check_links(text: str, page: Path, problems: list[str], repo: Path) -> None:
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if not (page.parent / path).resolve().exists():
            problems.append(f"link {target!r} points to nothing")


def check_page(text: str, page: Path, repo: Path = REPO) -> list[str]:
    """Every problem of one page (``page`` is where it lives: links are relative to it)."""
    problems: list[str] = []
    in_fence, fence_lang, header = False, "", None
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence, fence_lang = not in_fence, line.strip()[3:].strip().lower()
            continue
        if in_fence:
            if fence_lang in ("", "bash", "sh", "shell", "console"):
                check_command(line.lstrip("$ "), problems)
            continue
        if line.lstrip().startswith("|"):
            cells = _table_cells(line)
            if header is None:
                header = cells
            elif not all(re.fullmatch(r":?-+:?", c) for c in cells if c):
                for i, cell in enumerate(cells):
                    if i < len(header) and FOREIGN_COLUMN.search(header[i]):
                        continue
                    for span in CODE_SPAN.findall(cell):
                        check_span(span, problems)
                    _check_links(cell, page, problems, repo)
            continue
        header = None
        for span in CODE_SPAN.findall(line):
            check_span(span, problems)
        _check_links(CODE_SPAN.sub("", line), page, problems, repo)
    return problems


# -- the tests ------------------------------------------------------------------------------------


REMOVED_PATHS = (
    "megarl.rollout.http",
    "megarl.rollout.backend",
    "megarl.rollout.vllm",
    "megarl.rollout.sglang",
    "megarl.rollout.restarts",
    "megarl.bridge.control",
    "megarl.bridge.plan",
    "megarl.kernels.ppo_loss",
    "megarl.launcher.mpi",
    "megarl.workflow.context",
    "megarl.utils.recover",
    "megarl.utils.report",
)
"""Old module paths megarl removed: the changelog, and only it, names them (what a port must change)."""


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_page_names_only_what_exists(page):
    problems = check_page(page.read_text(encoding="utf-8"), page)
    if page.name == "changelog.md":
        problems = [p for p in problems if not any(f"'{path}'" in p for path in REMOVED_PATHS)]
    assert not problems, f"{page.relative_to(REPO)}:\n  " + "\n  ".join(problems)


def test_nav_and_pages_agree():
    """Every page of docs/ is in mkdocs.yml's nav and every nav entry is a page."""
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.MULTILINE))
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert nav - pages == set(), "nav entries without a page"
    assert pages - nav == set(), "pages missing from the nav"


def test_readme_first_screen():
    """Two set-up commands (make run, make test), the expectations and a link into the site."""
    first = (REPO / "README.md").read_text().split("\n## ")[0]
    block = re.search(r"```bash\n(.*?)```", first, re.DOTALL).group(1)
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == ["make run", "make test"]
    for expected in ("AMD EPYC", "GB", "min", "steps of", "reward", "docs/index.md", "make docs-serve"):
        assert expected in first, expected


# -- the checker itself, by construction ---------------------------------------------------------

PAGE = REPO / "docs" / "page.md"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Set `actor.no_such_key` to 1.", "config key 'actor.no_such_key' does not exist"),
        ("Run with `actor.optimizer.lrr=1e-5`.", "config key 'actor.optimizer.lrr'"),
        (
            "```bash\nmegarl run configs/arithmetic_grpo_cpu.yaml gconfig.n_sample=8\n```",
            "config key 'gconfig.n_sample'",
        ),
        ("```bash\nmegarl run configs/arithmetic_grpo_cpu.yaml nosuchblock.x=1\n```", "config key 'nosuchblock.x'"),
        ("Then `make test-learning`.", "make target 'test-learning' does not exist"),
        ("```bash\nmake docs no-such-target\n```", "make target 'no-such-target'"),
        ('```bash\nmake run RUN_ARGS="rollout.max_stalenes=1"\n```', "config key 'rollout.max_stalenes'"),
        ("See `configs/no_such.yaml`.", "path 'configs/no_such.yaml' does not exist"),
        ("See `tests/test_docs.py::test_no_such_test`.", "has no function 'test_no_such_test'"),
        ("`megarl slurm --no-such-flag`", "has no flag '--no-such-flag'"),
        ("`megarl deploy`", "megarl has no subcommand 'deploy'"),
        ("Pass `--no-such-flag`.", "no megarl subcommand takes '--no-such-flag'"),
        ("`megarl.config.NoSuchConfig`", "'NoSuchConfig' is not defined"),
        ("`python -m benchmarks.no_such_bench`", "Python name 'benchmarks.no_such_bench'"),
        ("`megarl.no_such_module.thing`", "'no_such_module' is not defined in megarl/__init__.py"),
        ("Read [this](guides/no-such-page.md).", "link 'guides/no-such-page.md' points to nothing"),
        ("| megarl | notes |\n|---|---|\n| `actor.kl_ctll` | x |", "config key 'actor.kl_ctll'"),
    ],
)
def test_checker_fails_on_a_name_that_does_not_exist(text, expected):
    problems = check_page(text, PAGE)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    "text",
    [
        "Set `actor.optimizer.lr`, `rollout.max_staleness=1` and `workflow.kwargs.anything=3`.",
        "AReaL's `rollout.group_size` loads as `workflow.group_size`.",
        "| megarl | AReaL | verl |\n|---|---|---|\n| `rollout.max_staleness` | `rollout.max_head_offpolicyness` | `actor_rollout_ref.rollout.n` |",
        '```bash\nmegarl slurm --dry-run --requeue --config configs/gsm8k_grpo_cpu.yaml recover.mode=auto\nmake run RUN_ARGS="total_train_steps=2"\n```',
        "`megarl run CONFIG [key=value ...]`, `benchmarks/results/*.json`, `configs/<the config>.yaml`, `RUN_DIR/stacks/`",
        "`megarl.reward.gsm8k.gsm8k_reward_fn`, `megarl.config.GRPOConfig`, `python -m megarl.train`",
        "`HF_HUB_OFFLINE=1`, `config.json`, `launcher.log`, `watchdog.jsonl`, `ppo_actor/gap/lag_{k}/...`, [site](https://example.org), [top](#top)",
        "```\nmegarl config: error: config error at 'x'\n```",
        "Read [the quickstart](quickstart.md) and [benchmarks](benchmarks.md).",
    ],
)
def test_checker_passes_what_exists(text):
    assert check_page(text, PAGE) == []


def test_the_command_table_lists_every_command():
    """`docs/guides/configs.md`'s command line table has a row for each `megarl` subcommand."""
    from megarl.launcher.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    table = (REPO / "docs" / "guides" / "configs.md").read_text().split("## The command line", 1)[1]
    rows = {m.group(1) for m in re.finditer(r"^\| `megarl ([\w-]+)", table, re.MULTILINE)}
    assert sorted(set(sub.choices) - rows) == [], "commands missing from the table"


def test_pages_speak_to_users_not_of_the_project_tracker():
    """No page, benchmark or kernel README cites the project's internal issue numbers ("issue 42")."""
    files = [REPO / "README.md", REPO / "csrc" / "README.md", *(REPO / "docs").rglob("*.md")]
    files += [*(REPO / "benchmarks").glob("*.py"), *(REPO / "examples").rglob("*.md")]
    cited = [
        f"{f.relative_to(REPO)}: {m.group(0)}" for f in files for m in re.finditer(r"(?i)\bissue #?\d+", f.read_text())
    ]
    assert cited == []


@pytest.mark.parametrize("page, prefix", [("README.md", "docs/"), ("docs/index.md", "")])
def test_the_guide_lists_have_every_guide_in_the_nav(page, prefix):
    nav = re.findall(r"^\s+- [^:]+: (guides/[\w\-]+\.md)$", (REPO / "mkdocs.yml").read_text(), re.MULTILINE)
    text = (REPO / page).read_text()
    assert nav and [g for g in nav if f"]({prefix}{g}" not in text] == []


def test_one_reward_signature_everywhere():
    """Pages and examples write the reward as the run calls it: AReaL's names, `completions` second."""
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "examples").rglob("*.py")]
    files += [*(REPO / "examples").rglob("*.md")]
    singular = re.compile(r"\(prompt(?:: str)?, completion(?:: str)?, prompt_ids")
    assert [str(f.relative_to(REPO)) for f in files if singular.search(f.read_text())] == []
