"""The main job's console, as a person sees it: a few start-up lines, a line per step, the summary.

``megarl run configs/gsm8k_grpo_cpu.yaml`` for 2 short steps, its output piped (as in CI):
everything else a trainer prints (Megatron, TE/Apex notices, stats tables, vLLM) is in the
run's log files, not on the console.

CI runs the main job anyway (``.ci/run``, the README's command): it checks that run's console with
:func:`check_console` (``python -m tests.train.test_main_job_console RUN_LOG RUN_DIR STEPS``) instead of
starting a second one, so the test itself runs with the slow tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.train.cli_run import GSM8K, QUIET_LOGGERS, megarl_run, read_metrics

SHORT_RUN = [
    "total_train_steps=2",
    "train_dataset.batch_size=2",
    "gconfig.n_samples=2",
    "gconfig.max_new_tokens=16",
    "evaluator.freq_steps=2",
    "evaluator.max_samples=2",
    "saver.freq_steps=null",
    *QUIET_LOGGERS,
]
STARTUP_LINES = 4  # what runs where, dtype, threads, servers ready
STEPS = 2


def check_console(console: str, run_dir: Path, steps: int) -> None:
    """A few start-up lines, one line per step (and the piped console's status lines), the summary; no
    library chatter, which the run's logs keep."""
    lines = console.splitlines()
    startup, rest = lines[:STARTUP_LINES], lines[STARTUP_LINES:]
    assert startup[1].startswith("dtype: trainer ") and startup[2].startswith("threads: "), console
    step_lines = [line for line in rest if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == [f"{i}/{steps}" for i in range(1, steps + 1)], console
    summary = rest[rest.index(next(line for line in rest if line.startswith("megarl: finished"))) :]
    status = [line for line in rest if line.startswith("train ")]  # at most one per 10 s of a piped console
    assert len(rest) <= steps * 3 + len(status) + len(summary), console
    assert len(lines) <= 25, console
    for noise in ("Apex", "warnings.warn", "[server-0]", "INFO", "\r"):
        assert noise not in console, (noise, console)
    logs = run_dir / "logs"
    trainer_log = (logs / "trainer.log").read_text()
    assert "Apex is not installed" in trainer_log and f"step {steps}/{steps}" in trainer_log  # kept, in the log
    assert "Application startup complete" in (logs / "server-0.log").read_text()
    # the train phase's throughput, on the console and in the metrics
    assert all(" tok/s" in line for line in step_lines), console
    assert all(step.get("perf/train_tokens_per_s", 0) > 0 for step in read_metrics(run_dir)), "no perf/ stats"


@pytest.mark.slow  # CI checks its own main-job run's console with check_console (.ci/run)
@pytest.mark.vllm
def test_main_job_console_has_a_few_lines(tmp_path):
    console = megarl_run(GSM8K, f"cluster.fileroot={tmp_path}", *SHORT_RUN)
    check_console(console, tmp_path / "gsm8k-grpo-cpu" / "trial0", STEPS)


if __name__ == "__main__":
    if len(sys.argv) != 4 or not sys.argv[3].isdigit():
        sys.exit(f"usage: python -m tests.train.test_main_job_console RUN_LOG RUN_DIR STEPS (got {sys.argv[1:]})")
    log, run_dir, steps = sys.argv[1:]
    try:
        check_console(Path(log).read_text(), Path(run_dir), int(steps))
    except AssertionError as e:
        sys.exit(f"the main job's console ({log}) is not what a person should see: {e}")
    print(f"the main job's console has {len(Path(log).read_text().splitlines())} lines, one per step and the summary")
