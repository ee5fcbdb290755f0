"""Figures the docs quote from benchmark results are the results' figures.

A figure taken from ``benchmarks/results/NAME.json`` is followed, in the Markdown, by a comment
that says where it comes from (invisible on GitHub and on the site)::

    exceeded the first 5's by +0.53 / +0.50 <!-- result: learning_arithmetic; gain; setup=fp32; +.2f -->

``NAME; FIELD; ROWS; [HOW ]FORMAT`` (semicolons: a ``|`` would split a table's cell):

* ``FIELD``: a column of the rows, or ``machine.KEY`` / any top-level ``KEY.SUB`` of the record (a
  list, such as ``machine.load_avg``, stands for its values);
* ``ROWS``: ``*`` for every row, or ``col=v1,v2`` conditions joined by ``&`` (a value may hold a
  comma: ``setup=bf16, nearest``);
* ``HOW``: ``each`` (default: one figure per selected row, in row order), or over the rows that
  hold a value (not null): ``min``, ``max``,
  ``mean``, ``median``, ``range`` (two figures: min and max), ``gain`` (the mean of the last 5
  values minus that of the first 5: the learning benchmarks' reward gain over steps), or
  ``ratio`` (the largest selected value over the smallest: "2.6x slower");
* ``FORMAT``: a Python format spec (``+.2f``, ``.1f``, ``.0f``, ``d``, ``.0%`` for a share as a
  percentage, ``.1e`` for ``1.2e-05``).

The test formats the selected values and compares them with the last figures written before
the comment in the same paragraph: change a result and the page must follow, or this fails. A
result measured while other work kept more cores busy than the machine has (its 1-minute load
average at the start above its core count) is no figure: quoting it fails. So does a result that does
not say its load (``machine.load_avg``), but for the few measured before the harness recorded it
(:data:`LOAD_NOT_RECORDED`, each naming the machine to measure it again on).
The README's "What to expect" paragraph and the home page's quote measurements only: there a
figure with a unit (``3.5 min``, ``19 s``, ``5 GB``, ``12%``, ``70x``) or a sign (``+0.5``) that
no marker covers fails too.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MARKER = re.compile(r"<!--\s*result:\s*(.*?)\s*-->", re.DOTALL)
NUMBER = re.compile(r"(?<![\w.])[+-]?\d+(?:\.\d+)?(?:e[+-]\d+)?")
HOWS = ("each", "min", "max", "mean", "median", "range", "gain", "ratio")
MEASURED = re.compile(
    r"(?<![\w.])[+-]?\d+(?:\.\d+)?(?:\s?(?:s|min|minutes|GB|MB|nats|GFLOP/s)|%|x)(?!\w)|(?<![\w.])[+-]\d"
)
"""A figure that states a measurement: a number with a unit, or a signed one."""


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "examples" / "README.md"]


LOAD_NOT_RECORDED: dict[str, str] = {}
"""Quoted results measured before the harness recorded the load, and what each must be measured on
again: none is left (each was measured again, or is no longer quoted); nothing is added here."""


def _rows(record: dict, where: str) -> list[dict]:
    rows = record["rows"]
    if where.strip() == "*":
        return rows
    for condition in where.split("&"):
        column, _, values = condition.partition("=")
        column, values = column.strip(), values.strip()
        if any(str(row.get(column)) == values for row in rows):  # "bf16, nearest" is one value
            wanted = {values}
        else:
            wanted = {v.strip() for v in values.split(",")}
        rows = [row for row in rows if str(row.get(column)) in wanted]
    return rows


def expected_figures(spec: str, results: Path = RESULTS) -> list[str]:
    """The figures a marker's ``NAME; FIELD; ROWS; [HOW ]FORMAT`` stands for, formatted."""
    parts = [p.strip() for p in spec.split(";")]
    if len(parts) != 4:
        raise ValueError(f"marker {spec!r}: want 'NAME; FIELD; ROWS; [HOW ]FORMAT'")
    name, field, where, fmt = parts
    how, _, fmt = fmt.rpartition(" ") if " " in fmt else ("each", "", fmt)
    if how not in HOWS:
        raise ValueError(f"marker {spec!r}: {how!r} is not one of {', '.join(HOWS)}")
    path = results / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"marker {spec!r}: no results file {name}.json in {results}")
    record = json.loads(path.read_text())
    busy = _busy(record.get("machine", {}))
    if busy:
        raise ValueError(
            f"marker {spec!r}: {name}.json was measured {busy}: re-measure it on a quiet machine to quote it"
        )
    if not record.get("machine", {}).get("load_avg") and name not in LOAD_NOT_RECORDED:
        raise ValueError(
            f"marker {spec!r}: {name}.json does not say the machine's load when it ran (machine.load_avg):"
            " re-measure it to quote it"
        )
    if "." in field and field.split(".")[0] in record and field.split(".")[0] != "rows":
        values = [record]
        for key in field.split("."):
            values = [values[0][key]]
    else:
        rows = _rows(record, where)
        if not rows or any(field not in row for row in rows):
            raise ValueError(f"marker {spec!r}: no rows {where!r} with a column {field!r} in {path.name}")
        values = [row[field] for row in rows]
    values = [v for value in values for v in (value if isinstance(value, list) else [value])]  # load_avg: 3
    if how != "each":  # a step that did not measure it (null) does not count in min, max, mean...
        values = [v for v in values if v is not None]
    if how == "range":
        values = [min(values), max(values)]
    elif how == "gain":
        values = [statistics.fmean(values[-5:]) - statistics.fmean(values[:5])]
    elif how == "ratio":
        values = [max(values) / min(values)]
    elif how != "each":
        values = [{"min": min, "max": max, "mean": statistics.fmean, "median": statistics.median}[how](values)]
    return [_fix_zero(format(v, fmt)).removesuffix("%") for v in values]  # "11%": the page's 11


def _busy(machine: dict) -> str | None:
    """Why a run's figures cannot be quoted: other work kept more cores busy than the machine has when it
    started (the 1-minute load average above the core count); None for a quiet run or one that did not
    record its load."""
    load, cores = machine.get("load_avg"), machine.get("cores")
    if load and cores and load[0] > cores:
        return f"at a load average of {load[0]:g} on {cores} cores"
    return None


def _fix_zero(text: str) -> str:
    return text.replace("-0.00", "0.00") if re.fullmatch(r"-0\.0*", text) else text


def check_text(text: str, results: Path = RESULTS) -> tuple[int, list[str]]:
    """(markers found, problems): each marker's figures against the figures written before it."""
    problems, count = [], 0
    for paragraph in re.split(r"\n\s*\n", text):
        count += _check_paragraph(paragraph, results, problems)[0]
    return count, problems


def _check_paragraph(paragraph: str, results: Path, problems: list[str]) -> tuple[int, set[int]]:
    """(markers, offsets of the figures they cover) of one paragraph; adds what differs to problems."""
    count, covered, start = 0, set(), 0
    for m in MARKER.finditer(paragraph):
        count += 1
        before = paragraph[start : m.start()]  # no marker in it: the previous one ends at start
        offset, start = start, m.end()
        try:
            want = expected_figures(m.group(1), results)
        except (ValueError, KeyError, TypeError) as e:
            problems.append(str(e))
            continue
        found = list(NUMBER.finditer(before))[-len(want) :]
        covered.update(offset + n.start() for n in found)
        got = [n.group() for n in found]
        if got != want:
            where = " ".join(before.split())[-80:]
            problems.append(f"'...{where}' quotes {got}, {m.group(1)!r} says {want}")
    return count, covered


def unmarked_figures(paragraph: str) -> list[str]:
    """The measurements (a number with a unit, or a signed one) no marker in the paragraph covers."""
    _, covered = _check_paragraph(paragraph, RESULTS, [])
    text = MARKER.sub(lambda m: " " * len(m.group()), paragraph)  # the same offsets, markers blanked
    return [m.group() for m in MEASURED.finditer(text) if m.start() not in covered]


def paragraph_starting(text: str, prefix: str) -> str:
    found = [p for p in re.split(r"\n\s*\n", text) if p.lstrip().startswith(prefix)]
    assert len(found) == 1, f"{len(found)} paragraphs start with {prefix!r}"
    return found[0]


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_quoted_figures_match_their_results(page):
    _, problems = check_text(page.read_text(encoding="utf-8"))
    assert not problems, f"{page.relative_to(REPO)}:\n  " + "\n  ".join(problems)


def test_the_pages_that_quote_learning_results_mark_them():
    """The README, home page and quickstart quote the learning check: each figure is marked."""
    for name in ("README.md", "docs/index.md", "docs/quickstart.md", "docs/concepts/precision.md"):
        count, _ = check_text((REPO / name).read_text())
        assert count >= 1, f"{name} quotes results but marks none"
    total = sum(check_text(p.read_text(encoding="utf-8"))[0] for p in doc_files())
    assert total >= 20, total


@pytest.mark.parametrize(
    "page, prefix", [("README.md", "**What to expect:**"), ("docs/index.md", "What to expect from `make run`")]
)
def test_what_to_expect_quotes_only_marked_figures(page, prefix):
    """Each measured figure in the paragraph a newcomer reads first comes from a results file."""
    paragraph = paragraph_starting((REPO / page).read_text(encoding="utf-8"), prefix)
    assert not unmarked_figures(paragraph), f"{page}: figures without a results marker: {unmarked_figures(paragraph)}"


# -- the checker itself ---------------------------------------------------------------------------


@pytest.fixture
def results(tmp_path):
    record = {
        "machine": {"cores": 2, "native_bf16": True, "load": [0.5, 2.0, 1.25], "load_avg": [0.5, 0.4, 0.3]},
        "rows": [
            {"setup": "fp32", "gain": 0.525, "step s": 13.2, "gap": 0.1},
            {"setup": "fp32", "gain": 0.5, "step s": 14.2, "gap": None},
            {"setup": "bf16", "gain": 0.44375, "step s": 10.3, "gap": 0.3},
        ],
    }
    (tmp_path / "learn.json").write_text(json.dumps(record))
    busy = {**record, "machine": {"cores": 2, "load_avg": [2.5, 1.0, 1.0]}}  # another process kept a core busy
    (tmp_path / "busy.json").write_text(json.dumps(busy))
    unknown = {**record, "machine": {"cores": 2}}  # measured without recording the load
    (tmp_path / "unknown.json").write_text(json.dumps(unknown))
    return tmp_path


@pytest.mark.parametrize(
    "text",
    [
        "gained +0.53 / +0.50 <!-- result: learn; gain; setup=fp32; +.2f --> in fp32",
        "steps of 13.2-14.2 s <!-- result: learn; step s; setup=fp32; range .1f -->",
        "about +0.5 <!-- result: learn; gain; *; mean +.1f -->, on 2 <!-- result: learn; machine.cores; *; d --> cores",
        "fp32 +0.53\nand bf16 +0.44 <!-- result: learn; gain; setup=bf16; +.2f -->",
        "no gain over 3 rows: +0.0 <!-- result: learn; step s; *; gain +.1f -->",
        "bf16 gains 44% <!-- result: learn; gain; setup=bf16 & step s=10.3; .0% --> a step",
        "fp32 steps 1.4x <!-- result: learn; step s; setup=fp32,bf16; ratio .1f --> as long as bf16's",
        "a gap of 5.1e-01 <!-- result: learn; gain; setup=fp32; mean .1e --> nats",
        "load average 0.5 to 2.0 <!-- result: learn; machine.load; *; range .1f -->",
        "gaps 0.1-0.3 <!-- result: learn; gap; *; range .1f --> where measured",
    ],
)
def test_checker_passes_figures_that_match(results, text):
    assert check_text(text, results) == (text.count("<!--"), [])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("gained +0.55 / +0.50 <!-- result: learn; gain; setup=fp32; +.2f -->", "quotes ['+0.55', '+0.50']"),
        ("gained +0.53 <!-- result: learn; gain; setup=fp32; +.2f -->", "says ['+0.53', '+0.50']"),
        ("steps of 13-14.2 s <!-- result: learn; step s; setup=fp32; range .1f -->", "['13', '14.2']"),
        ("+0.5\n\n<!-- result: learn; gain; *; mean +.1f -->", "quotes []"),
        ("x 1 <!-- result: nosuch; gain; *; .1f -->", "no results file"),
        ("x 1 <!-- result: learn; loss; *; .1f -->", "with a column 'loss'"),
        ("x 1 <!-- result: learn; gain; *; avg .1f -->", "'avg' is not one of"),
        ("x 1 <!-- result: learn; gain; .1f -->", "want 'NAME; FIELD; ROWS"),
        ("+0.53 <!-- result: busy; gain; setup=fp32; +.2f -->", "measured at a load average of 2.5 on 2 cores"),
        ("+0.53 <!-- result: unknown; gain; setup=fp32; +.2f -->", "does not say the machine's load"),
    ],
)
def test_checker_fails_on_a_figure_that_differs(results, text, expected):
    _, problems = check_text(text, results)
    assert any(expected in p for p in problems), problems


def test_a_measured_figure_without_a_marker_is_found():
    marked = "8 steps of 2-core runs gained +0.53 / +0.50 <!-- result: learning_arithmetic; gain; setup=fp32; +.2f -->"
    assert unmarked_figures(marked) == []
    assert unmarked_figures(marked + " in ~3.5 min, 10-19 s a step, 5 GB, 12%, 70x, +0.2") == [
        "3.5 min",
        "19 s",
        "5 GB",
        "12%",
        "70x",
        "+0",
    ]


def test_only_records_without_a_load_are_excused():
    """An excused record that now says its load (it was measured again) leaves :data:`LOAD_NOT_RECORDED`."""
    for name in LOAD_NOT_RECORDED:
        machine = json.loads((RESULTS / f"{name}.json").read_text())["machine"]
        assert not machine.get("load_avg"), f"{name}.json records its load now: take it out of LOAD_NOT_RECORDED"
