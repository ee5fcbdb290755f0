"""megarl.utils.keeper: what :func:`spawn` starts ends with its starter, however the starter dies.

Real processes throughout: a starter process spawns a child through the keeper; the child starts a
grandchild in a session of its own (as torchrun starts its ranks); the starter is then SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from megarl.utils.keeper import spawn, supported

pytestmark = pytest.mark.skipif(not supported(), reason="the keeper needs Linux prctl")

_GONE_WITHIN_S = 15.0
# The child: a grandchild in a new session (out of the child's process group), then both sleep.
_CHILD = textwrap.dedent(
    """
    import os, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(float(sys.argv[2]))
    """
)
# The starter: spawns the child through the keeper (from a thread that then ends, with argv[3]), sleeps.
_STARTER = textwrap.dedent(
    """
    import sys, threading, time
    from megarl.utils.keeper import spawn

    def start():
        spawn([sys.executable, "-c", sys.argv[1], sys.argv[2], "600"], scratch=sys.argv[4])

    if sys.argv[3] == "thread":
        thread = threading.Thread(target=start)
        thread.start()
        thread.join()
    else:
        start()
    time.sleep(600)
    """
)


def _read_pids(path: Path, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, "the child never wrote its pids"
        time.sleep(0.05)
    return [int(pid) for pid in path.read_text().split()]


def still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie has exited; a recycled pid is another process)."""
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_all_gone(procs: list[psutil.Process], timeout: float = _GONE_WITHIN_S) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (alive := still_running(procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _start_tree(tmp_path: Path, how: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """The starter, and every process below it (the keeper, the child, the grandchild) once all run."""
    pids = tmp_path / "pids"
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "engine.sock").touch()
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, _CHILD, str(pids), how, str(tmp_path / "scratch")])
    started = set(_read_pids(pids))
    tree = psutil.Process(starter.pid).children(recursive=True)
    assert started <= {proc.pid for proc in tree}
    return starter, tree


@pytest.mark.parametrize("how", ["main", "thread"])
def test_sigkilled_starter_takes_child_and_grandchild_with_it(tmp_path, how):
    starter, tree = _start_tree(tmp_path, how)
    try:
        if how == "thread":  # the starting thread ended: that is not the starter's death
            time.sleep(1.0)
            assert len(still_running(tree)) == len(tree), (
                "the keeper stopped its child when only the starting thread ended"
            )
        starter.kill()
        starter.wait()
        left = _wait_all_gone(tree)
        assert not left, f"{len(left)} of {len(tree)} outlived a SIGKILLed starter: {[p.cmdline() for p in left]}"
        assert not (tmp_path / "scratch").exists(), "the keeper left the command's scratch directory"
    finally:
        starter.kill()
        for proc in still_running(tree):
            proc.kill()


def test_exit_status_is_the_commands():
    assert spawn([sys.executable, "-c", "import sys; sys.exit(3)"]).wait() == 3
    assert spawn(["sh", "-c", "kill -9 $$"]).wait() == -signal.SIGKILL
    assert spawn(["/nonexistent/megarl-test-command"]).wait() == 127


def test_sigterm_reaches_the_command():
    proc = spawn([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(1.0)  # the keeper has started it
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM


def test_what_the_command_leaves_behind_is_stopped(tmp_path):
    pids = tmp_path / "pids"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # the child exits at once, its grandchild runs
    proc = spawn([sys.executable, "-c", _CHILD, str(pids), "0"], scratch=str(scratch))
    assert proc.wait(timeout=60) == 0
    assert not scratch.exists(), "the keeper left the exited command's scratch directory"
    _, grandchild = _read_pids(pids)
    try:
        left = _wait_all_gone([psutil.Process(grandchild)], timeout=0)
    except psutil.NoSuchProcess:
        left = []
    assert not left, "the exited command's grandchild outlived the keeper"
    for proc in left:
        proc.kill()


_PRIORITY = (
    "import os; print(os.nice(0), open('/proc/self/autogroup').read().split()[-1] "
    "if os.path.exists('/proc/self/autogroup') else '-')"
)


def _priority(nice: int) -> tuple[int, str]:
    """(nice value, session group's nice or "-") of a command ``spawn`` started at ``nice``."""
    proc = spawn([sys.executable, "-c", _PRIORITY], nice=nice, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    value, group = out.split()
    return int(value), group


def test_nice_lowers_the_commands_priority_and_its_sessions():
    """A server sharing the trainer's cores runs below it: its own nice value, and its session's scheduling
    group (``/proc/self/autogroup``), without which the nice value would not weigh against the trainer."""
    own = os.nice(0)
    value, group = _priority(7)
    assert value == own + 7
    assert group in ("-", "7")  # "-": a kernel without autogroups, where the nice value is all there is
    assert _priority(0)[0] == own
