"""The sbatch script's ``serve_slot``: a server step that ends is started again in its slot, within
``launcher.server_restarts`` / ``launcher.max_server_restarts``, each restart a line of
``server_restarts.jsonl`` for the trainer (a fake ``srun`` stands in for Slurm)."""

from __future__ import annotations

import json
import os
import subprocess

from megarl.launcher.slurm import render_sbatch
from megarl.serving.restarts import RESTARTS_FILE, RestartLog
from tests.launcher.test_slurm_render import config

# the fake srun: counts its runs per server index, writes the server's address once, then "dies"
FAKE_SRUN = """#!/bin/bash
idx=$(echo "$@" | sed -E 's/.*--index "?([0-9]+).*/\\1/')
echo run >> "$FAKE_DIR/runs-$idx"
echo "node$idx:1800$idx" > "$RUN_DIR/servers/$idx.addr"
exit 9
"""


def _serve_slot(script: str) -> str:
    lines = script.splitlines()
    start = lines.index("serve_slot() {")
    return "\n".join(lines[start : lines.index("}", start) + 1])


def _run_slots(tmp_path, per_server: int, per_run: int, slots: list[str]) -> subprocess.CompletedProcess:
    cfg = config(
        "gsm8k_grpo_cpu.yaml", f"launcher.server_restarts={per_server}", f"launcher.max_server_restarts={per_run}"
    )
    function = _serve_slot(render_sbatch(cfg, tmp_path / "c.yaml"))
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    (run_dir / "servers").mkdir(parents=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    body = "\n".join(
        [f"RUN_DIR={run_dir}", "NODES=(n0 n1)", function, *(f"serve_slot {slot}; echo status $?" for slot in slots)]
    )
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path), RUN_DIR=str(run_dir))
    return subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_a_server_step_is_restarted_in_its_slot_up_to_its_budget(tmp_path):
    log = RestartLog(tmp_path / "run", poll_s=0.0)
    result = _run_slots(tmp_path, per_server=2, per_run=10, slots=["0 0 0 18000"])
    assert result.stdout.splitlines() == ["status 9"], "the slot ends with the last step's status"
    assert (tmp_path / "runs-0").read_text().count("run") == 3, "the first start and 2 restarts"
    assert "restarting it in its slot (restart 2 of 2 for it, 2 of 10 this run)" in result.stderr
    assert "not restarted: launcher.server_restarts=2 restarts of server-0 are spent" in result.stderr
    lines = [json.loads(line) for line in (tmp_path / "run" / RESTARTS_FILE).read_text().splitlines()]
    assert [(r["server"], r["address"], r["exit_code"], r["restart"]) for r in lines] == [
        ("server-0", "node0:18000", 9, 1),
        ("server-0", "node0:18000", 9, 2),
    ]
    assert log.new_addresses() == ["node0:18000", "node0:18000"], "the trainer reads them"


def test_the_runs_budget_is_shared_by_every_slot(tmp_path):
    result = _run_slots(tmp_path, per_server=5, per_run=3, slots=["0 0 0 18000", "1 1 0 18001"])
    assert result.stdout.splitlines() == ["status 9", "status 9"]
    assert (tmp_path / "runs-0").read_text().count("run") == 4, "server-0 takes the run's 3 restarts"
    assert (tmp_path / "runs-1").read_text().count("run") == 1, "none left for server-1"
    assert "not restarted: launcher.max_server_restarts=3 restarts of this run are spent" in result.stderr
