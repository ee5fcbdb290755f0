"""process: tree termination (incl. SIGTERM-ignoring members) and kill-on-exit."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from megarl.utils.process import terminate_process_tree


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _spawn_tree(script: str, n_descendants: int) -> tuple[subprocess.Popen, list[int]]:
    """Start ``bash -c script`` and wait until it has ``n_descendants`` descendants."""
    proc = subprocess.Popen(["bash", "-c", script])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = psutil.Process(proc.pid).children(recursive=True)
        if len(kids) >= n_descendants:
            return proc, [k.pid for k in kids]
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"tree of {script!r} never reached {n_descendants} descendants")


def test_terminates_children_and_grandchildren():
    # bash -> 2 sleeps, and bash -> bash -> sleep (a grandchild).
    proc, descendants = _spawn_tree("sleep 100 & sleep 100 & bash -c 'sleep 100 & wait' & wait", 4)
    start = time.monotonic()
    terminate_process_tree(proc, timeout=5)
    assert time.monotonic() - start < 4  # SIGTERM was enough: no wait for the SIGKILL deadline
    # Reaped through the Popen; bash may exit on its own once its children die first.
    assert proc.returncode in (0, -signal.SIGTERM)
    assert all(_gone(pid) for pid in descendants)


def test_sigkills_processes_that_ignore_sigterm(caplog):
    # An ignored signal stays ignored across exec, so the sleep ignores SIGTERM too.
    proc, descendants = _spawn_tree("trap '' TERM; sleep 100 & wait", 1)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megarl.utils.process"):
        caplog.handler.setLevel(logging.WARNING)
        logging.getLogger("megarl.utils.process").addHandler(caplog.handler)
        try:
            terminate_process_tree(proc.pid, timeout=0.3)
        finally:
            logging.getLogger("megarl.utils.process").removeHandler(caplog.handler)
    assert 0.3 <= time.monotonic() - start < 5
    assert "survived signal 15" in caplog.text
    proc.wait(timeout=5)
    assert all(_gone(pid) for pid in [proc.pid, *descendants])


def test_process_group_catches_late_forks(tmp_path):
    # The root forks its long sleep only after the tree was captured; only the session's
    # process group can reach it. SIGTERM is ignored throughout, so SIGKILL must do it.
    pid_file = tmp_path / "late.pid"
    script = f"trap '' TERM; sleep 0.3; sleep 100 & echo $! > {pid_file}; wait"
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    time.sleep(0.1)  # bash is in its foreground `sleep 0.3`
    terminate_process_tree(proc, timeout=0.6)
    assert proc.returncode == -signal.SIGKILL
    assert _gone(int(pid_file.read_text()))


def test_children_only_and_already_gone():
    # Exit status 7 would mean the parent got SIGTERM; 3 that it ended on its own.
    proc, descendants = _spawn_tree("trap 'exit 7' TERM; sleep 100 & wait; exit 3", 1)
    terminate_process_tree(proc.pid, timeout=5, include_parent=False)
    assert all(_gone(pid) for pid in descendants)
    assert proc.wait(timeout=5) == 3
    terminate_process_tree(proc)  # already reaped: no error, no signal to a reused pid
    terminate_process_tree(proc.pid)


def test_refuses_to_terminate_itself():
    with pytest.raises(ValueError, match=f"pid {os.getpid()} is this process"):
        terminate_process_tree(os.getpid())


_PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    import psutil
    from megarl.utils.process import kill_on_exit
    child = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 100 & sleep 100 & wait"])
    kill_on_exit(child, timeout=0.3)
    while len(psutil.Process(child.pid).children()) < 2:
        time.sleep(0.01)
    print(child.pid, flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)
    time.sleep(100)
    """
)


@pytest.mark.parametrize("how", ["exit", "sigterm", "sigint"])
def test_kill_on_exit(how):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, how], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    tree = [child_pid] + [p.pid for p in psutil.Process(child_pid).children(recursive=True)]
    assert len(tree) == 3
    if how == "sigterm":
        parent.send_signal(signal.SIGTERM)
    elif how == "sigint":
        parent.send_signal(signal.SIGINT)
    code = parent.wait(timeout=10)
    # The parent still dies the way its previous handlers say: by SIGTERM, or through
    # KeyboardInterrupt, which Python turns into death by SIGINT.
    assert code == {"exit": 0, "sigterm": -signal.SIGTERM, "sigint": -signal.SIGINT}[how]
    assert all(_gone(pid) for pid in tree)
