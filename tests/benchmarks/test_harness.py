"""The benchmark harness writes JSON + markdown with machine, versions and date."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks._harness import markdown_table, run_benchmark

REPO = Path(__file__).resolve().parents[2]


def test_config_parse_benchmark_writes_results(tmp_path):
    record = run_benchmark("config_parse", quick=True, results_dir=tmp_path)
    data = json.loads((tmp_path / "config_parse.json").read_text())
    assert data == json.loads(json.dumps(record))
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
    assert "torch" in data["versions"] and "megarl" in data["versions"]
    assert data["date"].startswith("20")
    assert len(data["rows"]) == 4 and all(row["mean_us"] > 0 for row in data["rows"])
    md = (tmp_path / "config_parse.md").read_text()
    assert md.count("\n|") >= 5 and "mean_us" in md


def test_markdown_table_formats_floats_and_missing_cells():
    table = markdown_table([{"a": 1.23456789, "b": "x"}, {"a": 2, "c": None}])
    assert table.splitlines()[0] == "| a | b | c |"
    assert "| 1.235 | x |  |" in table


def test_runner_rejects_unknown_names():
    result = subprocess.run(
        [sys.executable, "benchmarks/run.py", "no_such_bench"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2 and "unknown benchmark" in result.stderr
