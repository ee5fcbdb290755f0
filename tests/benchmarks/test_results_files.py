"""Every result in ``benchmarks/results/`` says when, where and from which commit it was measured.

The harness (:func:`benchmarks._harness.run_benchmark`) fills these fields for every benchmark
script; results recorded before it kept a field carry it backfilled, saying so (``backfilled``).
The CPU's flags and whether it computes bf16 natively cannot be backfilled: a result without them
is re-run.
"""

from __future__ import annotations

import ast
import datetime
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks._harness import MACHINE_FIELDS, RECORD_FIELDS, RESULTS_DIR, run_benchmark

REPO = Path(__file__).resolve().parents[2]
COMMIT = re.compile(r"^[0-9a-f]{40}(-dirty)?$")
RESULT_FILES = sorted(RESULTS_DIR.glob("*.json"))


def record_problems(record: dict, known_commit=lambda sha: True) -> list[str]:
    """What a result record lacks or gets wrong (empty when it is complete)."""
    missing = [key for key in RECORD_FIELDS if key not in record]
    if missing:
        return [f"no {', '.join(missing)}"]
    problems = []
    machine = record["machine"]
    problems += [f"no machine.{key}" for key in MACHINE_FIELDS if key not in machine]
    try:
        datetime.datetime.fromisoformat(record["date"])
    except (TypeError, ValueError):
        problems.append(f"date {record['date']!r} is not ISO 8601")
    commit = machine.get("commit")
    if not (isinstance(commit, str) and COMMIT.match(commit)):
        problems.append(f"machine.commit {commit!r} is not a commit hash")
    elif not known_commit(commit.removesuffix("-dirty")):
        problems.append(f"machine.commit {commit} is not a commit of this repository")
    flags, bf16 = machine.get("cpu_flags"), machine.get("native_bf16")
    if not (isinstance(flags, str) and re.fullmatch(r"([a-z0-9_]+( [a-z0-9_]+)*)?", flags)):
        problems.append(
            f"machine.cpu_flags {flags!r} is not the CPU's flags (a run that did not record them is re-run)"
        )
    if not isinstance(bf16, bool):
        problems.append(f"machine.native_bf16 {bf16!r} is not true/false")
    if "backfilled" in machine and not machine.get("backfilled"):
        problems.append("a field was filled in afterwards but machine.backfilled does not say which and how")
    if not record["versions"].get("torch") or not record["versions"].get("megarl"):
        problems.append("versions lack torch or megarl")
    return problems


def _commit_exists(sha: str) -> bool:
    proc = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{sha}^{{commit}}"], capture_output=True)
    return proc.returncode == 0


def _has_git() -> bool:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_every_result_file_records_date_machine_commit_and_versions(path):
    record = json.loads(path.read_text())
    problems = record_problems(record, _commit_exists if _has_git() else (lambda sha: True))
    assert not problems, f"{path.relative_to(REPO)}: " + "; ".join(problems)
    assert path.with_suffix(".md").is_file(), f"{path.name} has no {path.stem}.md beside it"


def test_there_are_result_files():
    assert len(RESULT_FILES) >= 10


def test_a_fresh_record_has_every_field(tmp_path, monkeypatch):
    bench = types.ModuleType("benchmarks.fresh_bench")
    bench.TITLE = "fresh"
    bench.run = lambda quick: [{"x": 1.0}]
    monkeypatch.setitem(sys.modules, "benchmarks.fresh_bench", bench)
    record = run_benchmark("fresh_bench", results_dir=tmp_path)
    assert record_problems(record) == []
    machine = record["machine"]
    assert isinstance(machine["native_bf16"], bool) and machine["cpu_flags"] == machine["cpu_flags"].strip()
    assert len(machine["load_avg"]) == 3
    md = (tmp_path / "fresh_bench.md").read_text().splitlines()[2]
    assert "CPU flags: " in md and "bf16" in md and f"commit {machine['commit']}" in md


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda r: r["machine"].pop("commit"), "no machine.commit"),
        (lambda r: r["machine"].update(commit=None), "machine.commit None is not a commit hash"),
        (lambda r: r["machine"].pop("cpu_flags"), "no machine.cpu_flags"),
        (lambda r: r["machine"].update(native_bf16="yes"), "machine.native_bf16 'yes'"),
        (lambda r: r["machine"].update(cpu_flags="unknown (why)"), "is not the CPU's flags"),
        (lambda r: r["machine"].update(native_bf16="unknown"), "machine.native_bf16 'unknown' is not true/false"),
        (lambda r: r["machine"].update(backfilled=""), "backfilled does not say"),
        (lambda r: r.pop("date"), "no date"),
        (lambda r: r["versions"].pop("torch"), "versions lack torch"),
    ],
)
def test_checker_fails_on_an_incomplete_record(change, expected):
    record = {
        "name": "x",
        "title": "x",
        "date": "2026-11-25T08:00:00+00:00",
        "quick": False,
        "machine": dict.fromkeys(MACHINE_FIELDS, "x")
        | {"commit": "a" * 40, "cpu_flags": "avx avx2", "native_bf16": False},
        "versions": {"torch": "2.13.0", "megarl": "0.1.0"},
        "rows": [],
    }
    assert record_problems(record) == []
    change(record)
    assert any(expected in p for p in record_problems(record)), record_problems(record)


def _benchmark_modules() -> list[Path]:
    """benchmarks/*.py that define ``TITLE`` and ``run``: the benchmark scripts."""
    found = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        body = ast.parse(path.read_text()).body
        names = {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        funcs = {n.name for n in body if isinstance(n, ast.FunctionDef)}
        if "TITLE" in names or "run" in funcs:
            found.append(path)
    return found


@pytest.mark.parametrize("path", _benchmark_modules(), ids=lambda p: p.name)
def test_every_benchmark_script_writes_through_the_harness(path):
    """A script with its own writer could leave the machine fields out: each ends in the harness."""
    text = path.read_text()
    assert re.search(r"^TITLE = ", text, re.MULTILINE) and re.search(r"^def run\(quick", text, re.MULTILINE)
    assert "main_for(__name__)" in text or "run_benchmark(" in text, f"{path.name} does not use benchmarks._harness"
    writes = [
        line for line in text.splitlines() if "RESULTS_DIR" in line and re.search(r"\.json\b.*(write|dump)", line)
    ]
    assert not writes, f"{path.name} writes a results JSON itself: {writes}"
