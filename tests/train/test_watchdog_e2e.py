"""The watchdog in ``megarl run``: a trainer rank stalled on purpose is named on the console within
its budget, its stacks are written, and ``watchdog.action=abort`` ends the run (exit 3) with the
servers and the trainer stopped and the run directory kept; ``watchdog.action=restart`` resumes
from the last recover point."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from megarl.utils.heartbeat import FAULT_STALL_ENV, FAULT_STALL_ONCE_ENV, FAULT_STALL_PHASE_ENV
from tests.train.cli_run import ARITHMETIC, GSM8K, megarl_run, read_metrics

BUDGET_S = 20
# The hang runs in a phase of its own with a short budget; every real phase gets budgets far beyond
# what a loaded 2-core machine takes (the first runs of a phase: HEALTHY_S; once a phase has a median:
# at least HEALTHY_MIN_S), so the watchdog fires on the planted hang and never on healthy work.
STALL_PHASE = "injected_stall"
HEALTHY_S, HEALTHY_MIN_S = 1800, 900
TIMEOUT_S = 1500  # a whole run's wall-clock limit: only a hang the watchdog misses comes near it
WATCHDOG = [
    f"watchdog.budget_s={HEALTHY_S}",
    f"watchdog.min_budget_s={HEALTHY_MIN_S}",
    f"watchdog.phase_budget_s.{STALL_PHASE}={BUDGET_S}",
    "watchdog.interval_s=1",
]


@pytest.mark.slow  # a whole run; `make test` keeps the watchdog's own cases in tests/launcher/test_watchdog.py
@pytest.mark.vllm
def test_a_stalled_trainer_is_named_and_the_run_aborted(tmp_path):
    console = megarl_run(
        GSM8K,
        f"cluster.fileroot={tmp_path}",
        "total_train_steps=1",
        "stats_logger.wandb.mode=disabled",
        *WATCHDOG,
        "watchdog.action=abort",
        expect=3,
        timeout=TIMEOUT_S,
        env={FAULT_STALL_ENV: "trainer-0:build:600", FAULT_STALL_PHASE_ENV: STALL_PHASE},
    )
    ended = time.time()
    line = next(line for line in console.splitlines() if line.startswith("megarl watchdog:"))
    assert f"trainer-0 in phase '{STALL_PHASE}'" in line and f"(budget {BUDGET_S} s)" in line, line
    assert "watchdog: stopping the run (watchdog.action=abort)" in console
    run_dir = tmp_path / "gsm8k-grpo-cpu" / "trial0"
    (event,) = [json.loads(line) for line in (run_dir / "watchdog.jsonl").read_text().splitlines()]
    assert BUDGET_S <= event["seconds"] < BUDGET_S + 10, f"named once its budget ran out: {event}"
    assert ended - event["time"] < 120, "the run stopped soon after (start-up time is the machine's, not counted)"
    assert "_injected_stall" in (run_dir / "stacks" / "trainer-0.txt").read_text()
    assert (run_dir / "config.yaml").exists() and (run_dir / "watchdog.jsonl").exists()
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, f"processes of the run still alive: {leftovers}"


# Slow (~2.5 min): CI checks restart and resume with fake trainers (tests/launcher/test_local.py).
@pytest.mark.slow
@pytest.mark.vllm
def test_restart_resumes_from_the_last_recover_point(tmp_path):
    """``watchdog.action=restart``: the stalled trainer is stopped and started again from its recover
    point (after step 0); the run finishes with every step trained once."""
    once = tmp_path / "stalled-once"
    console = megarl_run(
        ARITHMETIC,
        f"cluster.fileroot={tmp_path}",
        "total_train_steps=3",
        "stats_logger.wandb.mode=disabled",
        "evaluator.freq_steps=null",
        "recover.mode=auto",
        "recover.retries=1",
        "recover.freq_steps=1",
        *WATCHDOG,
        "watchdog.action=restart",
        timeout=2 * TIMEOUT_S,
        env={
            FAULT_STALL_ENV: "trainer-0:train_step#2:600",
            FAULT_STALL_ONCE_ENV: str(once),
            FAULT_STALL_PHASE_ENV: STALL_PHASE,
        },
    )
    assert once.exists(), "the stall happened"
    line = next(line for line in console.splitlines() if line.startswith("megarl watchdog:"))
    assert f"trainer-0 in phase '{STALL_PHASE}' for" in line and f"(budget {BUDGET_S} s)" in line, line
    assert "watchdog: restarting the trainer from its last recover point (watchdog.action=restart)" in console
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    steps = [step["global_step"] for step in read_metrics(run_dir)]
    assert steps == [0, 1, 2], f"each step once, resumed after step 0: {steps}"
    assert "recover" in (run_dir / "logs" / "trainer.log").read_text().lower()
