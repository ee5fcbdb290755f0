"""StatsLogger outputs: console table, offline W&B, TensorBoard events, metrics.jsonl, curves.png, recovery."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megarl.config.run import StatsLoggerConfig, TensorBoardConfig, WandBConfig
from megarl.run.stats_logger import StatsLogger

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def stats_at(step: int, run: int = 0) -> dict[str, float]:
    """Stats of one step; ``run`` tells a recovered run's values from the first run's."""
    return {"rollout/reward": 0.1 * step + run, "ppo_actor/loss": 1.0 / (step + 1), "timing/step": 2.0}


def log_steps(stats_logger: StatsLogger, steps: range, run: int = 0) -> None:
    for step in steps:
        stats_logger.commit(step // 4, step % 4, step, stats_at(step, run))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def metric_points(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """(global step, value rounded to 6 places) of ``key`` in metrics.jsonl."""
    return [(row["global_step"], round(row[key], 6)) for row in read_metrics(run_dir)]


def tensorboard_points(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value rounded to 6 places) of ``key`` as TensorBoard reads the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, round(e.value, 6)) for e in events.Scalars(key)]


def quiet(**changes) -> StatsLoggerConfig:
    return StatsLoggerConfig(console=False, plot_keys=["rollout/reward", "eval/pass@1"], **changes)


def test_metrics_jsonl_has_one_line_per_step_with_position_and_stats(tmp_path):
    stats_logger = StatsLogger(quiet(), tmp_path)
    log_steps(stats_logger, range(5))
    stats_logger.close()
    rows = read_metrics(tmp_path)
    assert [row["global_step"] for row in rows] == list(range(5))
    assert rows[4] == {"epoch": 1, "epoch_step": 0, "global_step": 4, **stats_at(4)}


def test_curves_png_is_written_and_redrawn(tmp_path):
    stats_logger = StatsLogger(quiet(), tmp_path)
    stats_logger.commit(0, 0, 0, {"ppo_actor/loss": 1.0})
    assert not (tmp_path / "curves.png").exists()  # no plotted key has data yet
    log_steps(stats_logger, range(2))
    first = (tmp_path / "curves.png").read_bytes()
    log_steps(stats_logger, range(2, 6))
    second = (tmp_path / "curves.png").read_bytes()
    assert first.startswith(PNG_MAGIC) and second.startswith(PNG_MAGIC) and first != second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]  # no temporary left


def test_summary_compares_first_and_last_windows(tmp_path):
    stats_logger = StatsLogger(quiet(), tmp_path)
    log_steps(stats_logger, range(10))
    stats_logger.commit(2, 2, 10, {"eval/pass@1": 0.25})
    summary = stats_logger.summary(window=3)
    assert summary["rollout/reward"] == pytest.approx({"first_mean": 0.1, "last_mean": 0.8, "last": 0.9, "n_steps": 10})
    assert summary["eval/pass@1"] == {"first_mean": 0.25, "last_mean": 0.25, "last": 0.25, "n_steps": 1}
    assert "ppo_actor/loss" not in summary  # not a plotted key


def test_tensorboard_events_hold_the_values(tmp_path):
    stats_logger = StatsLogger(quiet(tensorboard=TensorBoardConfig(enabled=True)), tmp_path)
    log_steps(stats_logger, range(3))
    stats_logger.close()
    assert tensorboard_points(tmp_path, "ppo_actor/loss") == [(0, 1.0), (1, 0.5), (2, round(1 / 3, 6))]


def test_recovery_drops_redone_steps_everywhere(tmp_path):
    config = quiet(tensorboard=TensorBoardConfig(enabled=True))
    first = StatsLogger(config, tmp_path)
    log_steps(first, range(6))  # crash after step 5; the recover point was at step 2
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 1, "epoch_step": 2, "glob')  # killed mid-write
    resumed = StatsLogger(config, tmp_path, start_step=3)
    assert [row["global_step"] for row in read_metrics(tmp_path)] == [0, 1, 2]
    log_steps(resumed, range(3, 5), run=1)
    resumed.close()
    expected = [(0, 0.0), (1, 0.1), (2, 0.2), (3, 1.3), (4, 1.4)]
    assert metric_points(tmp_path, "rollout/reward") == expected
    assert tensorboard_points(tmp_path, "rollout/reward") == expected
    assert resumed.summary(window=2)["rollout/reward"]["n_steps"] == 5  # curves cover the whole run


def test_a_fresh_start_in_an_old_run_dir_starts_the_metrics_over(tmp_path):
    """As a trainer restarted before its first recover point: TensorBoard too holds the new steps only."""
    config = quiet(tensorboard=TensorBoardConfig(enabled=True))
    first = StatsLogger(config, tmp_path)
    log_steps(first, range(3))
    first.close()
    again = StatsLogger(config, tmp_path)
    log_steps(again, range(2), run=1)
    again.close()
    assert metric_points(tmp_path, "rollout/reward") == [(0, 1.0), (1, 1.1)]
    assert tensorboard_points(tmp_path, "rollout/reward") == [(0, 1.0), (1, 1.1)]


def test_a_resumed_run_keeps_the_evaluation_before_training(tmp_path):
    """The curves and the summary of a resumed run start from the first start's evaluation before
    training (which a resumed run does not repeat); a fresh start measures anew."""
    first = StatsLogger(quiet(), tmp_path)
    first.before_training({"eval/pass@1": 0.5, "eval/reward": 0.25})
    log_steps(first, range(3))
    first.close()
    resumed = StatsLogger(quiet(), tmp_path, start_step=2)
    assert resumed.before_training_stats == {"eval/pass@1": 0.5, "eval/reward": 0.25}
    assert resumed.baseline == {"eval/pass@1": 0.5}  # a plotted key: the curve starts from it at step 0
    assert StatsLogger(quiet(), tmp_path).before_training_stats == {}


def test_offline_wandb_run_is_resumed_after_recovery(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = quiet(wandb=WandBConfig(mode="offline", project="megarl-test"))
    stats_logger = StatsLogger(config, tmp_path, exp_config={"seed": 1})
    log_steps(stats_logger, range(2))
    stats_logger.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0
    StatsLogger(config, tmp_path, start_step=2).close()
    assert (tmp_path / "wandb_run_id").read_text() == run_id  # the same W&B run continues


def test_console_table_groups_keys_by_prefix(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megarl.run.stats_logger")
    stats_logger = StatsLogger(StatsLoggerConfig(plot_keys=[]), tmp_path)
    stats_logger.commit(1, 2, 6, {"ppo_actor/loss": 0.5, "ppo_actor/grad_norm": 3.0, "rollout/reward": 0.25})
    lines = caplog.records[-1].getMessage().splitlines()
    assert lines[0] == "epoch 1 step 2 (global step 6)"
    rows = [line.split() for line in lines[1:]]
    assert rows == [["ppo_actor", "grad_norm", "3"], ["loss", "0.5"], ["rollout", "reward", "0.25"]]


def test_other_ranks_write_nothing(tmp_path):
    stats_logger = StatsLogger(StatsLoggerConfig(tensorboard=TensorBoardConfig(enabled=True)), tmp_path / "run", rank=1)
    log_steps(stats_logger, range(3))
    stats_logger.close()
    assert not (tmp_path / "run").exists() and stats_logger.summary() == {}


def test_curves_count_steps_from_1_and_start_at_the_evaluation_before_training(tmp_path):
    """As the console and the report count: the first step is step 1; the evaluation before training is
    step 0, so a run evaluated once at its end draws a line from its start, not a point alone."""
    stats_logger = StatsLogger(quiet(), tmp_path)
    stats_logger.before_training({"eval/pass@1": 0.125, "eval/n_samples": 8.0})
    for step in range(8):
        stats = {"rollout/reward": step / 10} | ({"eval/pass@1": 0.25} if step == 7 else {})
        stats_logger.commit(0, step, step, stats)
    assert stats_logger.curve("eval/pass@1") == [(0, 0.125), (8, 0.25)]
    assert [x for x, _ in stats_logger.curve("rollout/reward")] == list(range(1, 9))
    assert stats_logger.summary()["eval/pass@1"]["first_mean"] == 0.25, "the summary is the run's steps"
    assert (tmp_path / "curves.png").stat().st_size > 0
