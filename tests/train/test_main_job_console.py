"""The main job's console, as a person sees it: a few start-up lines, a line per step, the summary.

``megarl run configs/gsm8k_grpo_cpu.yaml`` for 2 short steps, its output piped (as in CI):
everything else a trainer prints (Megatron, TE/Apex notices, stats tables, vLLM) is in the
run's log files, not on the console.
"""

from __future__ import annotations

import pytest

from tests.train.cli_run import GSM8K, QUIET_LOGGERS, megarl_run

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


@pytest.mark.vllm
def test_main_job_console_has_a_few_lines(tmp_path):
    console = megarl_run(GSM8K, f"cluster.fileroot={tmp_path}", *SHORT_RUN)
    lines = console.splitlines()
    startup, rest = lines[:STARTUP_LINES], lines[STARTUP_LINES:]
    assert startup[1].startswith("dtype: trainer ") and startup[2].startswith("threads: "), console
    step_lines = [line for line in rest if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["1/2", "2/2"], console
    summary = rest[rest.index(next(line for line in rest if line.startswith("megarl: finished"))) :]
    status = [line for line in rest if line.startswith("train ")]  # at most one per 10 s of a piped console
    assert len(rest) <= STEPS * 3 + len(status) + len(summary), console
    assert len(lines) <= 25, console
    for noise in ("Apex", "warnings.warn", "[server-0]", "INFO", "\r"):
        assert noise not in console, (noise, console)
    logs = tmp_path / "gsm8k-grpo-cpu" / "trial0" / "logs"
    trainer_log = (logs / "trainer.log").read_text()
    assert "Apex is not installed" in trainer_log and "step 2/2" in trainer_log  # the chatter is kept, in the log
    assert "Application startup complete" in (logs / "server-0.log").read_text()
