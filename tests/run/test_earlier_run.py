"""A fresh run into the directory of an earlier one moves the earlier one aside, whole; a resumed run keeps it;
a run still going holds its directory, and a second start on it is refused."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from megarl.config import GRPOConfig, save_config
from megarl.launcher.cli import main
from megarl.run import earlier_run as earlier_run_module
from megarl.run.earlier_run import (
    CHANGES_SHOWN,
    LOCK_FILE,
    RunDirInUse,
    claim_run_dir,
    keep_earlier_run,
    lock_run_dir,
)
from megarl.run.prelaunch import build_config
from megarl.utils.logging import WarnOnce

CPU_YAML = str(Path(__file__).resolve().parents[2] / "configs" / "arithmetic_grpo_cpu.yaml")


def config_at(tmp_path: Path, *overrides: str) -> GRPOConfig:
    return build_config(GRPOConfig, [CPU_YAML], [f"cluster.fileroot={tmp_path}", *overrides])


def earlier_run(run_dir: Path, steps: int, recover_point: bool | str = False) -> None:
    """``recover_point``: True writes a whole one (its file as its manifest lists it), ``"damaged"`` one whose
    file lost a byte after it was written."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("earlier: config\n")
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"global_step": {i}}}\n' for i in range(steps)))
    if recover_point:
        point = run_dir / "recover" / "step2"
        point.mkdir(parents=True)
        (point / "MANIFEST.json").write_text(json.dumps({"files": {"info_rank0.pt": 4}}))
        (point / "info_rank0.pt").write_bytes(b"abc" if recover_point == "damaged" else b"abcd")


@pytest.mark.parametrize(
    "mode,recover_point", [("disabled", False), ("disabled", True), ("auto", False), ("auto", "damaged")]
)
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
    assert (moved / "recover" / "step2").is_dir() == bool(recover_point)
    earlier_run(config.run_dir, 1)  # and again: another name beside the first
    keep_earlier_run(config)
    assert len(list(config.run_dir.parent.iterdir())) == 2


def test_a_resumed_run_or_one_without_steps_keeps_its_directory(tmp_path):
    config = config_at(tmp_path, "recover.mode=auto")
    earlier_run(config.run_dir, 3, recover_point=True)
    save_config(config)  # resumed with the run's own settings
    assert keep_earlier_run(config) is None and (config.run_dir / "metrics.jsonl").exists()
    assert sorted(p.name for p in config.run_dir.glob("config*")) == ["config.yaml"]
    empty = config_at(tmp_path, "trial_name=failed_at_start")
    earlier_run(empty.run_dir, 0)  # an earlier run that logged no step: nothing to keep
    assert keep_earlier_run(empty) is None and (empty.run_dir / "config.yaml").exists()
    assert keep_earlier_run(config_at(tmp_path, "trial_name=new")) is None  # no directory yet


def test_a_run_resumed_with_other_settings_keeps_the_earlier_config_and_names_each_change(tmp_path):
    earlier = config_at(tmp_path, "recover.mode=auto")
    earlier_run(earlier.run_dir, 3, recover_point=True)  # its point: recover/step2
    save_config(earlier)
    written = (earlier.run_dir / "config.yaml").read_text()
    config = config_at(tmp_path, "recover.mode=resume", "actor.loss=grpo", "total_train_steps=50")
    lock, said = claim_run_dir(config)
    try:
        assert config.run_dir.is_dir() and (config.run_dir / "metrics.jsonl").exists()  # not moved aside
        assert (config.run_dir / "config-until-step2.yaml").read_text() == written
        assert "resumes after step 2 with 4 setting(s) changed" in said and "config-until-step2.yaml" in said
        assert "actor.loss 'ppo' -> 'grpo'" in said and "total_train_steps 25 -> 50" in said
        assert "actor.loss_agg_mode 'token-mean' -> 'seq-mean-token-mean'" in said  # what the loss name set
        assert "recover.mode 'auto' -> 'resume'" in said and "more" not in said
    finally:
        lock.release()
    save_config(config)  # the run starts and writes its own; resumed again with another change
    again = config_at(tmp_path, "recover.mode=resume", "actor.loss=grpo", "total_train_steps=60")
    said = keep_earlier_run(again)
    assert "with 1 setting(s) changed" in said and "config-until-step2-2.yaml" in said
    assert "total_train_steps: 50" in (config.run_dir / "config-until-step2-2.yaml").read_text()


def test_many_changed_settings_are_counted_past_the_first_few(tmp_path):
    earlier = config_at(tmp_path, "recover.mode=auto")
    earlier_run(earlier.run_dir, 3, recover_point=True)
    (earlier.run_dir / "config.yaml").write_text("earlier: config\n")  # every setting differs from this
    said = keep_earlier_run(earlier)
    changed = int(re.search(r"with (\d+) setting\(s\) changed", said)[1])
    assert changed > CHANGES_SHOWN and said.count(" -> ") == CHANGES_SHOWN
    assert said.endswith(f"; and {changed - CHANGES_SHOWN} more")


@pytest.mark.parametrize("text", ["actor: [unclosed\n", "- a list\n", "x: ${nowhere}\n"])
def test_a_resumed_run_whose_saved_config_cannot_be_read_still_resumes_and_keeps_it(tmp_path, text):
    config = config_at(tmp_path, "recover.mode=auto")
    earlier_run(config.run_dir, 3, recover_point=True)
    (config.run_dir / "config.yaml").write_text(text)
    said = keep_earlier_run(config)
    assert "resumes after step 2; the run's config (kept as config-until-step2.yaml" in said
    assert "could not be read" in said and (config.run_dir / "config-until-step2.yaml").read_text() == text


# --------------------------------------------------------------------------------------
# A run still going is no earlier run: it holds its directory, and a second start is refused.
# --------------------------------------------------------------------------------------

HOLDER = """\
import subprocess, sys, time
from pathlib import Path
from megarl.run.earlier_run import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]))
# a child that outlives this process and was given every descriptor it could inherit
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], close_fds=False)
print(child.pid, flush=True)
time.sleep(300)
"""


def hold(run_dir: Path) -> tuple[subprocess.Popen, int]:
    """Another process holding ``run_dir`` as a live ``megarl run`` does; it and its child's pid."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    return holder, int(holder.stdout.readline())


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns)
        for p in root.rglob("*")
    }


def test_a_second_start_on_a_live_run_is_refused_and_touches_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("megarl.utils.logging.setup_logging", lambda *a, **k: None)  # keep the session's logging
    started = []

    def run_local(config, out=None):  # the run, as far as its directory goes: held while it runs
        started.append(config.run_dir)
        with pytest.raises(RunDirInUse):
            lock_run_dir(config.run_dir)
        return 0

    monkeypatch.setattr("megarl.launcher.local.run_local", run_local)
    argv = ["run", CPU_YAML, f"cluster.fileroot={tmp_path}"]
    run_dir = config_at(tmp_path).run_dir
    earlier_run(run_dir, 3)
    holder, child = hold(run_dir)
    try:
        before = snapshot(tmp_path)
        for mode in ("disabled", "auto"):
            assert main([*argv, f"recover.mode={mode}"]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith(f"megarl run: error: {run_dir} is in use by a run")
            assert f"pid {holder.pid} on {socket.gethostname()}" in err
            assert "wait for it to end, stop it, or start this one with another trial_name=..." in err
            assert snapshot(tmp_path) == before and started == []  # not moved, nothing written
        holder.kill()  # as SIGKILL ends a launcher: its child lives on, without the lock
        holder.wait()
        assert psutil.pid_exists(child)
        assert main(argv) == 0
    finally:
        for pid in (holder.pid, child):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        holder.wait()
    assert started == [run_dir] and "the earlier run was moved to" in capsys.readouterr().out
    (moved,) = [p for p in tmp_path.rglob(f"{run_dir.name}-*")]
    assert (moved / "config.yaml").read_text() == "earlier: config\n"  # the earlier run, whole
    assert (run_dir / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on ")  # the new run's own lock
    lock_run_dir(run_dir).release()  # and it let go when it ended


def test_a_filesystem_without_flock_runs_unguarded_with_one_warning(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    warned = []  # not caplog: the session's setup_logging may have cut the megarl logger off from the root
    monkeypatch.setattr(earlier_run_module, "_warn_unlockable", WarnOnce(earlier_run_module.logger))
    monkeypatch.setattr(earlier_run_module.logger, "warning", lambda msg, *args: warned.append(msg % args))
    monkeypatch.setattr(fcntl, "flock", no_flock)
    assert lock_run_dir(tmp_path / "a") is None and lock_run_dir(tmp_path / "b") is None
    assert len(warned) == 1 and "cannot lock" in warned[0] and "No locks available" in warned[0]
