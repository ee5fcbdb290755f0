"""A trainer killed with SIGKILL at random points of its recover dumps resumes exactly (issue 20).

The child process is a small trainer: a model and its Adam state, a seeded shuffling
``StatefulDataLoader``, and ``RecoverHandler`` dumping after every step (its writes take long
enough that most kills land inside one). It logs each step's batch and weight checksum. The
parent kills it 10 times at random moments and restarts it each time with ``recover.mode=auto``;
the steps of all runs together must equal, step for step, an uninterrupted run's: the same data
order, the same weights.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.config.allocation import TrainingAllocation
from megarl.config.run import RecoverConfig
from megarl.run.recover import RecoverHandler, RecoverInfo

REPO = Path(__file__).resolve().parents[2]
STEPS = 150  # more than 10 short lives reach, however fast this machine


class TorchEngine:
    """A model and optimizer that checkpoint with ``torch.save`` where MegatronEngine writes its own."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(512, 512)  # with Adam's moments: ~3 MiB per dump, several files
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        alloc = TrainingAllocation()
        self.parallel = SimpleNamespace(rank=0, world_size=1, alloc=alloc)

    def save(self, meta) -> None:
        path = Path(meta.path)
        path.mkdir(parents=True)
        torch.save(self.model.state_dict(), path / "model.pt")
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")

    def load(self, meta) -> None:
        path = Path(meta.path)
        self.model.load_state_dict(torch.load(path / "model.pt", weights_only=True))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))

    def step(self, batch: torch.Tensor) -> float:
        x = torch.sin(batch.float()[:, None] * torch.arange(1, 513) / 97)
        loss = (self.model(x) ** 2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(sum(p.double().sum() for p in self.model.parameters()))


def child(run_dir: str, log: str) -> None:
    """Train until step ``STEPS``, resuming from the recover point when there is one."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    engine = TorchEngine()
    loader = StatefulDataLoader(
        list(range(10_000)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    handler = RecoverHandler(RecoverConfig(mode="auto", freq_steps=1), Path(run_dir))
    info = handler.load(engine)
    start = 0 if info is None else info.global_step + 1
    if info is not None:
        loader.load_state_dict(info.dataloader_state)
    batches = iter(loader)
    with open(log, "a") as out:
        for step in range(start, STEPS):
            batch = next(batches)
            checksum = engine.step(batch)
            out.write(json.dumps({"step": step, "batch": batch.tolist(), "checksum": checksum}) + "\n")
            out.flush()
            handler.maybe_dump(engine, RecoverInfo(0, step, step, step, dataloader_state=loader.state_dict()))


def _start(run_dir: Path, log: Path) -> subprocess.Popen:
    code = f"from tests.run.test_kill_during_save import child; child({str(run_dir)!r}, {str(log)!r})"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


def _steps(log: Path) -> dict[int, dict]:
    """Each step's record; a step run twice (killed after it, before its dump) must repeat exactly."""
    seen: dict[int, dict] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        earlier = seen.setdefault(record["step"], record)
        assert earlier == record, f"step {record['step']} ran again differently: {earlier} vs {record}"
    return seen


@pytest.mark.slow  # ~1 min; tests/run/test_recover.py checks the dumps and loads in CI
def test_sigkill_during_dumps_resumes_with_the_same_data_and_weights(tmp_path):
    reference = tmp_path / "reference.jsonl"
    proc = _start(tmp_path / "reference", reference)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()

    log, rng, kills, mid_dump = tmp_path / "killed.jsonl", random.Random(0), 0, 0
    log.touch()
    while kills < 10:
        proc = _start(tmp_path / "run", log)
        started = len(log.read_text().splitlines())
        deadline = time.monotonic() + 120
        while len(log.read_text().splitlines()) == started and proc.poll() is None:  # past imports and load
            assert time.monotonic() < deadline, "the child made no step"
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.2))
        if proc.poll() is not None:
            assert proc.returncode == 0, proc.stderr.read()
            break  # finished before the kill: nothing left to interrupt
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        mid_dump += any((tmp_path / "run" / "recover").glob("step*.tmp"))
    assert kills == 10, f"the run finished after {kills} kills: make the steps slower or the waits shorter"
    assert mid_dump >= 3, f"only {mid_dump} of 10 kills landed inside a dump"
    proc = _start(tmp_path / "run", log)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert _steps(log) == _steps(reference)
    assert sorted(p.name for p in (tmp_path / "run" / "recover").iterdir()) == [f"step{STEPS - 2}", f"step{STEPS - 1}"]
