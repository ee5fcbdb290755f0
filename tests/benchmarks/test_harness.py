"""The benchmark harness writes JSON + markdown with machine, versions and date."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks._harness import cpu_kind, markdown_table, run_benchmark

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


def test_a_benchmark_may_name_its_results(tmp_path, monkeypatch):
    """fused_logprob keeps its GPU table in fused_logprob_gpu.*, beside the CPU one."""
    bench = types.ModuleType("benchmarks.named_bench")
    bench.TITLE = "named"
    bench.run = lambda quick: [{"x": 1}]
    bench.results_name = lambda: "named_bench_gpu"
    monkeypatch.setitem(sys.modules, "benchmarks.named_bench", bench)
    run_benchmark("named_bench", results_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["named_bench_gpu.json", "named_bench_gpu.md"]


def test_a_benchmark_summary_goes_above_its_table(tmp_path, monkeypatch):
    bench = types.ModuleType("benchmarks.summed_bench")
    bench.TITLE = "summed"
    bench.run = lambda quick: [{"reward": 0.25}, {"reward": 0.75}]
    bench.summary = lambda rows: f"gain {rows[-1]['reward'] - rows[0]['reward']:+.2f}"
    monkeypatch.setitem(sys.modules, "benchmarks.summed_bench", bench)
    record = run_benchmark("summed_bench", results_dir=tmp_path)
    assert record["summary"] == "gain +0.50"
    md = (tmp_path / "summed_bench.md").read_text()
    assert md.index("gain +0.50") < md.index("| reward |")


def test_learning_summary_is_the_tests_gain():
    from benchmarks.learning_arithmetic import summary

    rows = [{"setup": "fp32", "gain": 0.5}, {"setup": "fp32", "gain": 0.3}, {"setup": "bf16", "gain": 0.4}]
    assert summary(rows).startswith("fp32: gain +0.50 / +0.30 (mean +0.40); bf16: gain +0.40 (mean +0.40) (bar: +0.3")


def test_learning_gain_is_last_five_minus_first_five():
    from benchmarks.learning_arithmetic import reward_gain

    assert reward_gain([0.1, 0.2, 0.3, 0.2, 0.2, 0.5, 0.6, 0.7, 0.6, 0.6]) == pytest.approx((0.2, 0.6))


def test_fused_logprob_gpu_table_does_not_replace_the_cpu_one(monkeypatch):
    from benchmarks import fused_logprob

    monkeypatch.setattr(fused_logprob.torch.cuda, "is_available", lambda: True)
    assert fused_logprob.results_name() == "fused_logprob_gpu"
    monkeypatch.setattr(fused_logprob.torch.cuda, "is_available", lambda: False)
    assert fused_logprob.results_name() == "fused_logprob"


def test_markdown_table_formats_floats_and_missing_cells():
    table = markdown_table([{"a": 1.23456789, "b": "x"}, {"a": 2, "c": None}])
    assert table.splitlines()[0] == "| a | b | c |"
    assert "| 1.235 | x |  |" in table


def test_runner_rejects_unknown_names():
    result = subprocess.run(
        [sys.executable, "benchmarks/run.py", "no_such_bench"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2 and "unknown benchmark" in result.stderr


def test_a_run_is_dirty_for_a_changed_source_not_for_another_benchmarks_results(tmp_path, monkeypatch):
    """Benchmarks run one after another write results files: those alone leave the next run's tree clean."""
    from benchmarks import _harness

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    for name in ("benchmarks/results/a.json", "docs/benchmarks.md", "megarl/x.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("0\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(_harness, "REPO", tmp_path)
    monkeypatch.delenv("MEGARL_COMMIT", raising=False)
    (tmp_path / "benchmarks/results/a.json").write_text("1\n")
    (tmp_path / "docs/benchmarks.md").write_text("1\n")
    assert not _harness.source_commit().endswith("-dirty")
    (tmp_path / "megarl/x.py").write_text("1\n")
    assert _harness.source_commit().endswith("-dirty")


def test_a_pipe_in_a_column_or_a_value_does_not_split_its_cell():
    header, rule, row = markdown_table([{"gap (mean |logp diff|)": 1.5, "setup": "a|b"}]).splitlines()
    assert header == "| gap (mean \\|logp diff\\|) | setup |" and row == "| 1.5 | a\\|b |"
    assert rule == "|---|---|"


@pytest.mark.parametrize(
    ("flags", "kind"),
    [
        ("avx avx2 fma", "avx2"),
        ("avx avx2 avx512f avx512bw avx512_vnni fma", "avx512"),
        ("avx2 avx512f avx512_bf16 fma", "avx512_bf16"),
        ("amx_bf16 amx_tile avx2 avx512f avx512_bf16", "amx"),
        ("", "avx2"),
    ],
)
def test_cpu_kind_names_the_table_of_each_cpu_kind(flags, kind):
    assert cpu_kind(flags) == kind


def test_a_scripts_own_option_sets_its_variable_and_a_bad_value_is_named(monkeypatch, capsys):
    import benchmarks._harness as harness

    ran = []
    monkeypatch.setattr(harness, "run_benchmark", lambda name, quick: ran.append((name, quick)) or {})
    monkeypatch.setattr(harness, "print_record", lambda record: None)
    monkeypatch.delenv("MEGARL_TEST_DTYPES", raising=False)
    script = types.ModuleType("benchmarks.peer")
    script.CLI_OPTIONS = {"--dtype": ("MEGARL_TEST_DTYPES", {"both": "bfloat16,float32", "float32": "float32"})}
    monkeypatch.setitem(sys.modules, "benchmarks.peer", script)
    monkeypatch.setattr(sys, "argv", ["peer.py", "--dtype", "both", "--quick"])
    harness.main_for("benchmarks.peer")
    assert os.environ["MEGARL_TEST_DTYPES"] == "bfloat16,float32" and ran == [("peer", True)]
    monkeypatch.setattr(sys, "argv", ["peer.py", "--dtype", "float16"])
    with pytest.raises(SystemExit):
        harness.main_for("benchmarks.peer")
    assert "--dtype: invalid choice: 'float16'" in capsys.readouterr().err and len(ran) == 1
