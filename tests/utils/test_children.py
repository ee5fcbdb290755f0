"""children: a Child is started under a keeper, marked and registered, and its stop undoes all three."""

import subprocess
import sys
import textwrap
import time

import psutil

from megarl.utils import process
from megarl.utils.children import Child

# the command starts a grandchild in a session of its own (as torchrun does with its ranks), prints its pid
_SCRIPT = textwrap.dedent(
    """
    import subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    print(grandchild.pid, flush=True)
    time.sleep(120)
    """
)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _registered(child: Child) -> bool:
    return child.pid in process._EXIT_CLEANUP._procs


def test_stop_ends_the_command_and_what_it_started_and_forgets_it():
    child = Child([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    grandchild = int(child.stdout.readline())
    command = child.command_pid()
    assert command != child.pid, "the command runs under its keeper"
    assert _registered(child), "stopped at this process's exit"
    assert _environ(grandchild).get(process.LAUNCH_TAG_ENV) == child.mark.tag
    child.stop(5.0)
    deadline = time.monotonic() + 10
    while not (_gone(grandchild) and _gone(command)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(command) and _gone(grandchild)
    assert child.poll() is not None and not _registered(child)
    child.stop(5.0)  # idempotent


def _environ(pid: int, timeout: float = 5.0) -> dict[str, str]:
    """The environment of process ``pid``; read again while it comes back empty (a loaded machine can show a
    process's environment empty for a moment after it started)."""
    deadline = time.monotonic() + timeout
    while not (environ := psutil.Process(pid).environ()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return environ


def test_stop_after_the_command_died_kills_its_leftovers():
    child = Child([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    grandchild = int(child.stdout.readline())
    psutil.Process(child.command_pid()).kill()  # the command dies on its own
    child.wait(10)
    child.stop(5.0)
    deadline = time.monotonic() + 15
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild) and not _registered(child)
