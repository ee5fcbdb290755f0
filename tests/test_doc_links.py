"""Links read on GitHub work: every relative link of the README, ``docs/`` and the example and launch
READMEs points to a file of the repository, and an ``#anchor`` to a heading of its page.

The pages ``docs/_hooks.py`` generates (the supported models, the benchmark results and what has run
where) are committed so that links to them work outside the site; the build replaces them with fresh copies,
and :func:`test_generated_pages_are_committed_fresh` fails when a committed copy is stale.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`\n]+`")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXPLICIT_ID = re.compile(r"""(?:id|name)=["']([^"']+)["']|\{\s*#([\w-]+)[^}]*\}""")


def pages() -> list[Path]:
    found = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return found + [p for p in (REPO / "examples" / "README.md", REPO / "launch" / "README.md") if p.exists()]


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(line)
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation but - and _ removed,
    each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


@functools.cache
def anchors(text: str) -> frozenset[str]:
    """Every anchor of a Markdown text: its headings' slugs (numbered when repeated) and explicit ids."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(text):
        found.update(a or b for a, b in EXPLICIT_ID.findall(CODE_SPAN.sub("", line)))
        if m := HEADING.match(line):
            slug = github_slug(EXPLICIT_ID.sub("", m.group(2)).strip())
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return frozenset(found)


def link_problems(page: Path, text: str | None = None) -> list[str]:
    """Every relative link of ``page`` that points to no file, or to no heading of its page."""
    problems = []
    text = page.read_text(encoding="utf-8") if text is None else text
    for line in _prose_lines(text):
        line = CODE_SPAN.sub("", line)
        for target in LINK.findall(line) + IMAGE.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            if not path:  # this page
                if anchor not in anchors(text):
                    problems.append(f"link {target!r}: this page has no heading #{anchor}")
                continue
            resolved = (page.parent / path).resolve()
            if not resolved.exists():
                problems.append(f"link {target!r}: {path} does not exist")
            elif REPO not in resolved.parents and resolved != REPO:
                problems.append(f"link {target!r} leaves the repository")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
                problems.append(f"link {target!r}: {resolved.relative_to(REPO)} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_to_a_file_and_heading(page):
    problems = link_problems(page)
    assert not problems, f"{page.relative_to(REPO)}:\n  " + "\n  ".join(problems)


def _hooks():
    spec = importlib.util.spec_from_file_location("megarl_docs_hooks", REPO / "docs" / "_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_committed_fresh():
    """docs/benchmarks.md, docs/what-has-run.md and docs/reference/models.md, as committed, are what the
    hook generates now."""
    stale = [
        uri
        for uri, content in _hooks().generated_pages().items()
        if not (REPO / "docs" / uri).exists() or (REPO / "docs" / uri).read_text(encoding="utf-8") != content
    ]
    assert not stale, f"stale generated pages {stale}: run `python docs/_hooks.py` and commit them"


def test_promised_rows_show_under_a_script_with_one_table_per_cpu_kind(tmp_path, monkeypatch):
    """A script whose results are all per-kind tables (``x_avx2``, ``x_avx512``, no ``x``) still lists
    what it promised and no run measured, once, under its last table; a measured promise drops out."""
    hooks = _hooks()
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (tmp_path / "benchmarks" / "x.py").write_text("")
    monkeypatch.setattr(hooks, "PROMISED", {"x": [("kind", "amx", "an AMX CPU"), ("kind", "avx2", "an AVX2 CPU")]})
    for kind in ("avx2", "avx512"):
        record = {"name": "x", "title": "X", "rows": [{"kind": kind, "s": 1.0}]}
        (results / f"x_{kind}.json").write_text(json.dumps(record))
    page = hooks.benchmarks_page(results)
    assert page.count("| kind amx | not measured | an AMX CPU |") == 1
    assert "kind avx2 | not measured" not in page
    assert page.index("## x_avx512") < page.index("| kind amx | not measured")


def test_what_has_run_comes_from_the_result_files(tmp_path, monkeypatch):
    """Each place is filled by the results that ran there, with their machine, date, commit and load;
    a place no result ran in says "not run", and a result without a load average is no figure."""
    hooks = _hooks()
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for script in ("learning_x", "kernel_x"):
        (tmp_path / "benchmarks" / f"{script}.py").write_text("")
    monkeypatch.setattr(hooks, "SERVERS", {"learning_x": "vLLM"})
    monkeypatch.setattr(hooks, "RL_STEP", {"learning_x"})
    avx2 = {"cpu": "AMD EPYC", "cores": 2, "cpu_flags": "avx avx2 fma", "commit": "a" * 40, "load_avg": [0.5, 1, 1]}
    gpu = {**avx2, "gpu": "NVIDIA H200", "cores": 16, "commit": "b" * 40 + "-dirty"}
    del gpu["load_avg"]
    records = {"learning_x_avx2": avx2, "kernel_x_gpu": gpu, "learning_x_gpu": {**gpu, "gpus": 8, "nodes": 2}}
    for name, machine in records.items():
        (results / f"{name}.json").write_text(
            json.dumps({"date": "2026-01-02T03:04:05", "machine": machine, "rows": []})
        )
    page = hooks.what_has_run_page(results)
    row = {line.split(" | ")[0].lstrip("| "): line for line in page.splitlines() if line.startswith("| ")}
    assert "learning_x_avx2" in row["CPU: AVX2 only"] and "kernel_x_gpu" not in row["CPU: AVX2 only"]
    assert "**not run**" in row["CPU: AMX"]
    assert "kernel_x_gpu" in row["GPU: NVIDIA H200"] and "learning_x_gpu" in row["GPU: NVIDIA H200"]
    assert "learning_x_gpu" in row["more than one machine"] and "kernel_x_gpu" not in row["more than one machine"]
    assert "learning_x_gpu" in row["vLLM servers on CUDA"] and "learning_x_avx2" in row["vLLM-CPU servers"]
    assert "learning_x_gpu" in row["an RL step on a GPU"] and "**not run**" in row["SGLang servers"]
    (gpu_row,) = [line for line in page.splitlines() if line.startswith("| [`kernel_x_gpu`]")]
    assert "2026-01-02" in gpu_row and "`bbbbbbbbbbbb` + uncommitted changes" in gpu_row
    assert "not recorded: timings not figures" in gpu_row


# -- the checker itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("See [x](no-such-page.md).", "no-such-page.md does not exist"),
        ("See [x](README.md#no-such-heading).", "has no heading #no-such-heading"),
        ("See [x](#nowhere).", "has no heading #nowhere"),
        ("![plot](no.png)", "no.png does not exist"),
        ("[up](../../outside.md)", "does not exist"),
    ],
)
def test_checker_finds_a_broken_link(text, expected):
    problems = link_problems(REPO / "page.md", text)
    assert any(expected in p for p in problems), problems


def test_checker_passes_links_that_work():
    text = (
        "[a](docs/index.md), [b](docs/concepts/architecture.md#floors-who-may-import-whom), "
        "[c](https://example.org/x.md), [d](benchmarks/results/plan.md), `[e](nowhere.md)`, "
        "[f](docs/benchmarks.md#learning_arithmetic), [g](#the-checker)\n\n## The checker\n"
    )
    assert link_problems(REPO / "page.md", text) == []


def test_slugs_are_githubs():
    assert github_slug("Floors: who may import whom") == "floors-who-may-import-whom"
    assert github_slug("`megarl plan` and [the rates](x.md)") == "megarl-plan-and-the-rates"
    assert github_slug("learning_arithmetic") == "learning_arithmetic"
    assert github_slug("Coming from AReaL, verl or TRL") == "coming-from-areal-verl-or-trl"
