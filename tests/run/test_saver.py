"""FrequencyControl (counts, time, recovery state, rank 0's decision on 2 ranks) and Saver on a stub engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config.run import SaverConfig
from megarl.run import saver as saver_mod
from megarl.run.saver import FrequencyControl, Saver, incomplete_reason
from tests.actor.dist_utils import run_ranks


class Clock:
    """A settable ``time.monotonic``."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(saver_mod.time, "monotonic", fake)
    return fake


def fire_pattern(freq: FrequencyControl, calls: list[dict]) -> list[bool]:
    return [freq.check(**kwargs) for kwargs in calls]


def test_steps_frequency_fires_every_n_steps():
    freq = FrequencyControl(freq_steps=3)
    assert fire_pattern(freq, [{}] * 7) == [False, False, True, False, False, True, False]


def test_epochs_frequency_counts_epochs_only():
    freq = FrequencyControl(freq_epochs=2)
    calls = [{"epochs": 0}, {"epochs": 1}, {"epochs": 0}, {"epochs": 1}, {"epochs": 1}, {"epochs": 1}]
    assert fire_pattern(freq, calls) == [False, False, False, True, False, True]


def test_no_frequency_never_fires():
    assert not any(fire_pattern(FrequencyControl(), [{"epochs": 5, "steps": 100}] * 3))


def test_seconds_frequency_uses_elapsed_time_and_resets(clock):
    freq = FrequencyControl(freq_secs=10)
    clock.now += 9
    assert not freq.check()
    clock.now += 1
    assert freq.check()
    clock.now += 5
    assert not freq.check()  # counting restarted at the trigger


def test_any_set_frequency_triggers_and_resets_all_counts(clock):
    freq = FrequencyControl(freq_steps=4, freq_secs=10)
    freq.check()
    clock.now += 10
    assert freq.check()  # time first
    assert fire_pattern(freq, [{}] * 4) == [False, False, False, True]  # step counts restarted too


def test_state_dict_resumes_counts_and_elapsed_time(clock):
    freq = FrequencyControl(freq_steps=5, freq_secs=100)
    fire_pattern(freq, [{}] * 2)
    clock.now += 60
    state = freq.state_dict()
    clock.now += 500  # the restart's downtime does not count
    by_time, by_steps = FrequencyControl(freq_steps=5, freq_secs=100), FrequencyControl(freq_steps=5)
    by_time.load_state_dict(state)
    by_steps.load_state_dict(state)
    clock.now += 39
    assert not by_time.check()
    clock.now += 1
    assert by_time.check()  # 60 + 40 seconds
    assert fire_pattern(by_steps, [{}] * 3) == [False, False, True]  # 2 + 3 steps


def decide_on_ranks() -> list[bool]:
    """On 2 gloo ranks: a time frequency only rank 1's clock has reached, then one only rank 0's has."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    only_rank1, only_rank0 = FrequencyControl(freq_secs=3600), FrequencyControl(freq_secs=3600)
    (only_rank1 if rank == 1 else only_rank0).start -= 7200
    return [only_rank1.check(), only_rank0.check(), only_rank0.check()]


@pytest.mark.multiproc
def test_time_decision_is_rank0s_on_every_rank():
    assert run_ranks(2, "tests.run.test_saver:decide_on_ranks", timeout=120) == [[False, True, False]] * 2


class StubEngine:
    """Writes a marker file where MegatronEngine would write a checkpoint."""

    def __init__(self):
        self.version = 0
        self.saved: list = []

    def save(self, meta) -> None:
        Path(meta.path).mkdir(parents=True)
        (Path(meta.path) / "common.pt").write_text(str(self.version))
        self.saved.append(meta)

    def export_hf(self, path) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_text("weights")

    def get_version(self) -> int:
        return self.version


def run_steps(saver: Saver, engine: StubEngine, steps: range, steps_per_epoch: int = 100) -> list[int]:
    saved = []
    for step in steps:
        engine.version = step + 1
        if saver.maybe_save(engine, step // steps_per_epoch, step % steps_per_epoch, step) is not None:
            saved.append(step)
    return saved


def test_saver_writes_megatron_checkpoint_meta_and_hf(tmp_path):
    saver, engine = Saver(SaverConfig(freq_steps=2, export_hf=True), tmp_path), StubEngine()
    assert run_steps(saver, engine, range(2)) == [1]
    ckpt = tmp_path / "checkpoints" / "globalstep1"
    assert (ckpt / "model" / "common.pt").read_text() == "2"
    assert (ckpt / "hf" / "model.safetensors").is_file()
    assert json.loads((ckpt / "meta.json").read_text()) == {"epoch": 0, "epoch_step": 1, "global_step": 1, "version": 2}
    meta = engine.saved[0]
    assert meta.weight_format == "megatron" and meta.with_optim


def test_saver_without_optimizer_state_saves_weights_only(tmp_path):
    saver, engine = Saver(SaverConfig(freq_steps=1, with_optim=False), tmp_path), StubEngine()
    assert run_steps(saver, engine, range(1)) == [0]
    assert engine.saved[0].with_optim is False


def test_saver_keeps_last_n_and_cleans_interrupted_writes(tmp_path):
    saver, engine = Saver(SaverConfig(freq_steps=1, keep_last=2), tmp_path), StubEngine()
    interrupted = tmp_path / "checkpoints" / "globalstep0.tmp" / "model"
    interrupted.mkdir(parents=True)  # a crash mid-save of step 0: redoing step 0 must not trip over it
    (tmp_path / "checkpoints" / "globalstep3.old").mkdir()  # a crash while step 3 was written again: put back
    run_steps(saver, engine, range(3))
    assert (tmp_path / "checkpoints" / "globalstep3").is_dir()
    run_steps(saver, engine, range(3, 5))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["globalstep3", "globalstep4"]
    assert not (tmp_path / "checkpoints" / "globalstep4" / "hf").exists()  # export_hf off
    newest = tmp_path / "checkpoints" / "globalstep4"
    assert incomplete_reason(newest) is None and "meta.json" in (newest / "MANIFEST.json").read_text()
    (newest / "meta.json").write_text("{}")
    assert incomplete_reason(newest).startswith("meta.json has 2 bytes, ")


def test_saver_epoch_frequency_saves_at_the_last_step_of_every_other_epoch(tmp_path):
    saver = Saver(SaverConfig(freq_epochs=2), tmp_path, steps_per_epoch=3)
    assert run_steps(saver, StubEngine(), range(12), steps_per_epoch=3) == [5, 11]


def test_saver_epoch_frequency_needs_the_epoch_length(tmp_path):
    with pytest.raises(ValueError, match="steps_per_epoch"):
        Saver(SaverConfig(freq_epochs=1), tmp_path)


def test_forced_save_restarts_the_count_skips_repeats_and_state_round_trips(tmp_path):
    saver, engine = Saver(SaverConfig(freq_steps=3), tmp_path), StubEngine()
    run_steps(saver, engine, range(2))
    assert saver.maybe_save(engine, 0, 2, 2, force=True) == tmp_path / "checkpoints" / "globalstep2"
    assert saver.maybe_save(engine, 0, 2, 2, force=True) is None  # the same step again: nothing new to save
    assert len(engine.saved) == 1
    state = saver.state_dict()
    resumed = Saver(SaverConfig(freq_steps=3), tmp_path)
    resumed.load_state_dict(state)
    assert run_steps(resumed, engine, range(3, 9)) == [5, 8]


def test_saver_writes_the_critic_beside_the_actor(tmp_path):
    saver, actor, critic = Saver(SaverConfig(freq_steps=1, export_hf=True), tmp_path), StubEngine(), StubEngine()
    actor.version, critic.version = 4, 9
    assert saver.maybe_save({"model": actor, "critic": critic}, 0, 0, 0) is not None
    ckpt = tmp_path / "checkpoints" / "globalstep0"
    assert (ckpt / "model" / "common.pt").read_text() == "4" and (ckpt / "critic" / "common.pt").read_text() == "9"
    assert (ckpt / "hf" / "model.safetensors").is_file() and (ckpt / "critic_hf" / "model.safetensors").is_file()
    assert json.loads((ckpt / "meta.json").read_text())["version"] == 4
    with pytest.raises(ValueError, match="actor under 'model'"):
        saver.maybe_save({"critic": critic}, 0, 1, 1)


def test_an_older_directory_stays_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """Publishing over an older ``final`` (a recover point written again, ``megarl convert-point``): the old
    one is whole whenever the new one is not, and gone once it is."""
    final = tmp_path / "step3"
    final.mkdir()
    (final / "old.txt").write_text("old")

    def new_dir() -> Path:
        tmp = tmp_path / "step3.tmp"
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
        return tmp

    rename = Path.rename

    def failing(self, target):
        if self.name == "step3.tmp":
            raise OSError("injected: the rename failed")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError, match="injected"):
        saver_mod.publish_dir(new_dir(), final)
    assert (final / "old.txt").read_text() == "old" and not (tmp_path / "step3.old").exists()
    monkeypatch.setattr(Path, "rename", rename)
    saver_mod.publish_dir(tmp_path / "step3.tmp", final)
    assert sorted(p.name for p in final.iterdir()) == ["MANIFEST.json", "new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step3"]
