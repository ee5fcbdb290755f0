"""benchmarks/gpu_kit.sh: per-step time limits, going on after a failure, the summary, skips."""

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "benchmarks/gpu_kit.sh"


def _kit(outdir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": os.environ.get("PYTHON", "python3"), **env}
    return subprocess.run(
        ["bash", str(KIT), str(outdir), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
        cwd=REPO,
    )


def _statuses(outdir: Path) -> dict[str, str]:
    rows = [line.split("|") for line in (outdir / "summary.md").read_text().splitlines() if line.startswith("| ")]
    return {cells[1].strip(): cells[2].strip() for cells in rows if cells[1].strip() != "step"}


def test_the_dry_run_goes_end_to_end_on_cpu(tmp_path):
    proc = _kit(tmp_path / "out", "--dry", PYTHON=str(REPO / ".venv/bin/python"))
    assert proc.returncode == 0, proc.stderr
    statuses = _statuses(tmp_path / "out")
    assert statuses == {
        "env": "ok",
        **{s: "skipped: no GPU" for s in ("build", "tests_sm90", "tests_sm80", "kernels", "actor")},
    }
    log = (tmp_path / "out/kit.log").read_text()
    assert "== env (budget 20s)" in log and "torch 2." in log


def test_a_failed_or_hung_step_does_not_stop_the_next_and_each_is_recorded_when_it_ends(tmp_path):
    out = tmp_path / "out"
    # `check` runs after the others: it passes only if their output and summary lines are
    # already in OUTDIR while the kit is still running
    check = (
        f'grep -q "output of fail" {out}/kit.log && grep -q "| fail | failed (rc 3)" {out}/summary.md && '
        f'grep -q "| hang | timed out after 2s" {out}/summary.md'
    )
    start = time.monotonic()
    proc = _kit(
        out,
        MEGARL_KIT_STEPS="fail hang check build",
        MEGARL_KIT_DRY="1",
        MEGARL_KIT_CMD_fail="echo output of fail; exit 3",
        MEGARL_KIT_CMD_hang="sleep 60",
        MEGARL_KIT_BUDGET_hang="2",
        MEGARL_KIT_CMD_check=check,
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 30  # the hung step was cut at its budget
    assert _statuses(out) == {
        "fail": "failed (rc 3)",
        "hang": "timed out after 2s",
        "check": "ok",
        "build": "skipped: no GPU",
    }


def test_without_megatron_core_the_actor_step_says_how_to_get_it(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexit 1\n")  # no module imports, megatron.core included
    fake_python.chmod(0o755)
    proc = _kit(tmp_path / "out", PYTHON=str(fake_python), MEGARL_KIT_STEPS="actor", MEGARL_KIT_DRY="0")
    assert proc.returncode == 0, proc.stderr
    assert _statuses(tmp_path / "out") == {"actor": "skipped: megatron-core not installed (run the wheel script)"}


@pytest.mark.parametrize("args", [[], ["out", "--wet"], ["out", "--dry", "extra"]])
def test_bad_arguments_print_the_usage(tmp_path, args):
    proc = subprocess.run(
        ["bash", str(KIT), *args], check=False, capture_output=True, text=True, cwd=tmp_path, timeout=30
    )
    assert proc.returncode == 2 and "usage: bash benchmarks/gpu_kit.sh OUTDIR [--dry]" in proc.stderr
