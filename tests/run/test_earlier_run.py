"""A fresh run into the directory of an earlier one moves the earlier one aside, whole; a resumed run keeps it."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import GRPOConfig
from megarl.run.earlier_run import keep_earlier_run
from megarl.run.prelaunch import build_config

CPU_YAML = str(Path(__file__).resolve().parents[2] / "configs" / "arithmetic_grpo_cpu.yaml")


def config_at(tmp_path: Path, *overrides: str) -> GRPOConfig:
    return build_config(GRPOConfig, [CPU_YAML], [f"cluster.fileroot={tmp_path}", *overrides])


def earlier_run(run_dir: Path, steps: int, recover_point: bool = False) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("earlier: config\n")
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"global_step": {i}}}\n' for i in range(steps)))
    if recover_point:
        (run_dir / "recover" / "step2").mkdir(parents=True)
        (run_dir / "recover" / "step2" / "MANIFEST.json").write_text("{}")


@pytest.mark.parametrize("mode,recover_point", [("disabled", False), ("disabled", True), ("auto", False)])
def test_a_fresh_run_moves_the_earlier_one_aside(tmp_path, mode, recover_point):
    config = config_at(tmp_path, f"recover.mode={mode}")
    earlier_run(config.run_dir, 3, recover_point)
    said = keep_earlier_run(config)
    assert not config.run_dir.exists()
    (moved,) = [p for p in config.run_dir.parent.iterdir()]
    assert moved.name.startswith(f"{config.run_dir.name}-") and f"moved to {moved}" in said
    assert "(3 steps logged)" in said and f"recover.mode={mode}" in said
    assert (moved / "config.yaml").read_text() == "earlier: config\n"
    assert len((moved / "metrics.jsonl").read_text().splitlines()) == 3
    assert (moved / "recover" / "step2").is_dir() == recover_point
    earlier_run(config.run_dir, 1)  # and again: another name beside the first
    keep_earlier_run(config)
    assert len(list(config.run_dir.parent.iterdir())) == 2


def test_a_resumed_run_or_one_without_steps_keeps_its_directory(tmp_path):
    config = config_at(tmp_path, "recover.mode=auto")
    earlier_run(config.run_dir, 3, recover_point=True)
    assert keep_earlier_run(config) is None and (config.run_dir / "metrics.jsonl").exists()
    empty = config_at(tmp_path, "trial_name=failed_at_start")
    earlier_run(empty.run_dir, 0)  # an earlier run that logged no step: nothing to keep
    assert keep_earlier_run(empty) is None and (empty.run_dir / "config.yaml").exists()
    assert keep_earlier_run(config_at(tmp_path, "trial_name=new")) is None  # no directory yet
