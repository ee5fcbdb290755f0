"""A real vLLM-CPU server SIGKILLed under ``megarl run``: the launcher restarts it in its slot, the
trainer pushes it the current weights, the lost episodes run again from scratch, the run finishes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.train.cli_run import ARITHMETIC, read_metrics, start_megarl


def _server_pids(launcher: psutil.Process) -> list[int]:
    """The launcher's server processes (its direct children other than the trainer's torchrun)."""
    pids = []
    for child in launcher.children():
        try:
            if "torch.distributed.run" not in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def _kill_at_random_points(launcher: subprocess.Popen, run_dir: Path, kills: int, seed: int, killed: list) -> None:
    """SIGKILL the server ``kills`` times, each at a random moment after one more step has finished
    and the previous restart is back in rotation (a line of metrics.jsonl since)."""
    rng = random.Random(seed)
    proc = psutil.Process(launcher.pid)
    metrics = run_dir / "metrics.jsonl"
    while len(killed) < kills and launcher.poll() is None:
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if steps > len(killed):  # one kill per finished step at most: the run keeps making progress
            time.sleep(rng.uniform(0.0, 6.0))
            pids = _server_pids(proc)
            if pids and launcher.poll() is None:
                os.kill(pids[0], signal.SIGKILL)
                killed.append((steps, pids[0]))
        time.sleep(0.2)


def _run(tmp_path: Path, steps: int, kills: int, seed: int) -> tuple[subprocess.CompletedProcess, Path, list]:
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    args = [
        "run",
        ARITHMETIC,
        f"cluster.fileroot={tmp_path}",
        f"total_train_steps={steps}",
        "stats_logger.wandb.mode=disabled",
        "evaluator.freq_steps=null",
        "rollout.dump_trajectories=true",
        "gconfig.seed=7",
        f"launcher.server_restarts={kills}",
        f"launcher.max_server_restarts={kills}",
    ]
    launcher = start_megarl(*args)
    killed: list = []
    killer = threading.Thread(target=_kill_at_random_points, args=(launcher, run_dir, kills, seed, killed), daemon=True)
    killer.start()
    out, _ = launcher.communicate(timeout=1500)
    killer.join(5)
    return subprocess.CompletedProcess(launcher.args, launcher.returncode, out), run_dir, killed


def _check(result, run_dir: Path, killed: list, steps: int, kills: int) -> None:
    console = result.stdout
    assert result.returncode == 0, console[-4000:]
    assert len(killed) == kills, f"the server was killed {len(killed)} times, not {kills}: {killed}"
    restarts = [json.loads(line) for line in (run_dir / "server_restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == kills and all(r["exit_code"] == -signal.SIGKILL for r in restarts), restarts
    assert "restarting it in its slot (restart 1 of" in console
    metrics = read_metrics(run_dir)
    assert [m["global_step"] for m in metrics] == list(range(steps))
    assert metrics[-1]["rollout/server_restarts"] == kills, "the metrics show every restart"
    readmitted = sum(
        m.get("weight_sync/servers_readmitted", 0) + m.get("weight_sync/servers_readmitted_in_rollout", 0)
        for m in metrics
    )
    # A kill may land on a restart still starting (seed 1 killed one 7 s after it was started): that
    # process never serves and is never readmitted, so not every restart shows here; the version
    # check below is what shows that no token came from other weights than its step's.
    assert 1 <= readmitted <= kills, f"restarted servers got the weights before serving: {readmitted}"
    # every item trained exactly once: each step's episodes (synchronous RL: exactly the batch) are 8
    # distinct prompts, none seen at another step; each episode whole (its 8 samples, none half of a lost one)
    seen: list[str] = []
    for version in range(steps):
        files = sorted((run_dir / "rollout" / str(version)).glob("*.jsonl"))
        rows = [[json.loads(line) for line in f.read_text().splitlines()] for f in files]
        assert len(rows) == 8, f"version {version}: {len(rows)} episodes, not the batch of 8"
        for episode in rows:
            assert len(episode) == 8, f"an episode of {len(episode)} samples: a rerun mixed with a lost run"
            assert len({r["prompt"] for r in episode}) == 1
            assert all(v == version for r in episode for v in r["versions"]), "a token of other weights"
            seen.append(episode[0]["prompt"])
    assert len(seen) == len(set(seen)) == 8 * steps, "an item trained twice, or lost"


@pytest.mark.vllm
@pytest.mark.slow  # 6.5 min on the shared 2-core machine
def test_a_killed_server_is_restarted_and_the_run_finishes(tmp_path):
    result, run_dir, killed = _run(tmp_path, steps=3, kills=1, seed=0)
    _check(result, run_dir, killed, steps=3, kills=1)


@pytest.mark.vllm
@pytest.mark.slow
def test_five_kills_in_ten_steps(tmp_path):
    """The issue's acceptance: SIGKILL the server 5 times at random points of one 10-step run."""
    result, run_dir, killed = _run(tmp_path, steps=10, kills=5, seed=1)
    _check(result, run_dir, killed, steps=10, kills=5)
