"""Child processes that end with the process that started them, however it dies (Linux).

:func:`spawn` starts a command under a *keeper*, ``python -m megarl.utils.keeper PARENT -- CMD``: a
small process between the caller and the command that

* asks the kernel for a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``), SIGKILL and the
  OOM killer included, and then stops its whole tree: SIGTERM, a short grace, SIGKILL;
* is the subreaper of its tree (``prctl(PR_SET_CHILD_SUBREAPER)``): a process whose parent died is
  re-parented to the keeper instead of init, so it stays in the tree that gets stopped. That is how
  vLLM's engine core (whose API server died) and torchrun's ranks (which lead sessions of their own,
  out of any process group the caller could signal) are reached;
* when the command exits, stops what it left behind and exits with the command's status (killed by
  the same signal when the command was);
* passes SIGTERM, SIGINT and SIGHUP on to the command, which gets SIGTERM if the keeper itself dies;
* with ``nice``, lowers the CPU priority of the session it leads, and so of the whole tree (see
  :func:`lower_priority`);
* with ``scratch``, removes that directory once the tree is gone: the command's sockets and files that
  nobody else would remove when it was killed.

Why a process and not ``PR_SET_PDEATHSIG`` on the child alone: the setting is not inherited through
``fork``, so it would reach vLLM's server and torchrun but not the engine core or the ranks they start,
and once such a grandchild is orphaned no tree walk finds it. The signal fires when the *thread* that
forked the keeper ends, which need not be the caller's death (a server started from a short-lived
thread): the keeper acts only once its parent process has changed (``getppid``).

Limits: Linux only; elsewhere :func:`spawn` starts the command directly (a launcher that is SIGKILLed
there leaves its children running, as before). A SIGKILLed keeper takes its command with it (SIGTERM)
but not the command's own children, which then go to init. A descendant that leaves the tree on its
own (a daemon double-forking below another subreaper, a process started through a service manager or
a container runtime) is out of reach.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from megarl.utils.process import terminate_process_tree

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PARENT_GONE = signal.SIGUSR2  # the keeper's own parent-death signal; SIGTERM means "stop the command"
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_GRACE_S = 5.0  # nobody waits for an orphaned tree: a short grace for clean exits, then SIGKILL
_LEFTOVER_GRACE_S = 3.0
_LATE_KILL_S = 5.0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def supported() -> bool:
    """Whether this system lets a child follow its parent's death (Linux ``prctl``)."""
    return _libc() is not None


def _prctl(option: int, value: int) -> None:
    if _libc().prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}, {value}): {os.strerror(errno)}")


def kept(cmd: Sequence[str], nice: int = 0, scratch: str | None = None) -> list[str]:
    """``cmd`` run under a keeper that ends it (and all it starts) when this process dies, at ``nice``;
    the directory ``scratch`` is removed once the command's whole tree is gone."""
    if not supported():
        return list(cmd)
    options = [*(["--nice", str(nice)] if nice else []), *(["--scratch", scratch] if scratch else [])]
    return [sys.executable, "-m", __name__, str(os.getpid()), *options, "--", *cmd]


def spawn(cmd: Sequence[str], nice: int = 0, scratch: str | None = None, **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)`` under a keeper (module docstring).

    The ``Popen``'s pid is the keeper's: signals to it reach ``cmd``, its exit status is ``cmd``'s, and
    it leads the new session and process group, which ``cmd`` shares. ``nice`` > 0: the tree runs at
    that lower CPU priority (Linux; elsewhere the command starts at this process's). ``scratch``: a
    directory of the command's own (its sockets, say), removed by the keeper after the whole tree
    stopped, however it stopped (elsewhere the caller removes it).
    """
    return subprocess.Popen(kept(cmd, nice, scratch), start_new_session=True, **popen_kwargs)


def lower_priority(nice: int) -> None:
    """Lower this process's CPU priority by ``nice``, and that of the session it leads.

    Where the kernel groups each session for scheduling (``CONFIG_SCHED_AUTOGROUP``, on by default on
    most distributions), a process's own nice value only weighs against its session's other processes,
    so the session's group gets it too (``/proc/self/autogroup``); without autogroups, ``os.nice``
    weighs against every process. Lowering needs no privilege.
    """
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups in this kernel, or disabled: os.nice is what counts
        pass


def stop(popen: subprocess.Popen, timeout: float) -> None:
    """Stop a command that :func:`spawn` started: SIGTERM to its keeper alone, which passes it on to
    the command once and, once the command exits, stops what it left; the whole tree gets SIGKILL
    after ``timeout``. (Signalling the tree as well would reach the command two or three times, and a
    server that removed its handler after the first one dies by the next without its shutdown.)"""
    if popen.poll() is not None:
        return
    if not supported():
        terminate_process_tree(popen, timeout=timeout)
        return
    popen.terminate()
    try:
        popen.wait(timeout + _LEFTOVER_GRACE_S)
    except subprocess.TimeoutExpired:
        logger.warning("pid %d did not stop within %.0f s of SIGTERM: killing its tree", popen.pid, timeout)
        terminate_process_tree(popen, timeout=0.0, sig=signal.SIGKILL)


def command_pid(popen: subprocess.Popen, wait_s: float = 5.0) -> int:
    """The pid of the command that :func:`spawn` started (the keeper's first child), for what must
    reach the command itself (``SIGSTOP``, ``py-spy``); ``popen.pid`` where no keeper runs, or when
    the command is not (or no longer) there within ``wait_s``."""
    import psutil

    if not supported():
        return popen.pid
    deadline = time.monotonic() + wait_s
    while True:
        try:
            children = psutil.Process(popen.pid).children()
        except psutil.NoSuchProcess:
            return popen.pid
        if children:  # orphans re-parented to the keeper come later: the oldest child is the command
            return min(children, key=lambda c: (c.create_time(), c.pid)).pid
        if time.monotonic() > deadline or popen.poll() is not None:
            return popen.pid
        time.sleep(0.01)


def exit_with_parent() -> None:
    """Exit this process once the process that started it is gone, even SIGKILLed.

    For processes started by a library rather than by :func:`spawn` (a ``ProcessPoolExecutor``'s
    workers: use it as the pool's initializer). A thread polls ``getppid`` each second, which works
    on any POSIX system and does not depend on which thread started the process.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class _ParentGone(Exception):
    pass


def _on_parent_signal(parent: int, signum, frame) -> None:
    if os.getppid() != parent:  # else only the thread that started the keeper ended
        raise _ParentGone


def _follow_parent(keeper: int) -> None:
    """``preexec_fn`` of the command: SIGTERM when the keeper dies (unless it already has)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != keeper:
        os._exit(1)


def _start(cmd: list[str]) -> subprocess.Popen:
    """The command as the keeper's child (it inherits the keeper's stdio, environment and session)."""
    child = subprocess.Popen(cmd, preexec_fn=functools.partial(_follow_parent, os.getpid()))  # noqa: PLW1509 -- the keeper has one thread

    def forward(signum, frame) -> None:
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    return child


def _wait_for(pid: int) -> int:
    """Reap children (orphans re-parented here too) until ``pid`` exits; its wait status."""
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            return status


def _stop_tree(grace: float) -> None:
    """Stop every descendant of the keeper, SIGKILL what outlives ``grace`` or appeared meanwhile."""
    terminate_process_tree(os.getpid(), timeout=grace, include_parent=False)
    terminate_process_tree(os.getpid(), timeout=_LATE_KILL_S, sig=signal.SIGKILL, include_parent=False)
    while True:  # reap: none of them is left as a zombie of the keeper
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _exit_like(status: int) -> None:
    """Exit as the command did: the same code, or killed by the same signal."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the command's core dump (if any) is its own
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # a signal whose default is not to end the process
    os._exit(os.waitstatus_to_exitcode(status))


_USAGE = "usage: python -m megarl.utils.keeper PARENT_PID [--nice N] [--scratch DIR] -- CMD [ARG...]"


def _parse(argv: list[str]) -> tuple[int, int, str | None, list[str]]:
    """(parent pid, nice, scratch directory, command) of ``PARENT_PID [--nice N] [--scratch DIR] -- CMD...``."""
    options = {"--nice": "0", "--scratch": None}
    parent, rest = argv[:1], argv[1:]
    while len(rest) > 1 and rest[0] in options:
        options[rest[0]], rest = rest[1], rest[2:]
    if not parent or len(rest) < 2 or rest[0] != "--":
        sys.exit(_USAGE)
    return int(parent[0]), int(options["--nice"]), options["--scratch"], rest[1:]


def _stop_tree_and_clean(grace: float, scratch: str | None) -> None:
    _stop_tree(grace)
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str]) -> None:
    """The keeper: ``PARENT_PID [--nice N] [--scratch DIR] -- CMD...`` (see the module docstring)."""
    parent, nice, scratch, cmd = _parse(argv)
    logging.basicConfig(level=logging.WARNING, format="megarl keeper %(process)d: %(message)s")
    if nice:
        lower_priority(nice)  # before the command starts: all it starts inherits it
    signal.signal(_PARENT_GONE, functools.partial(_on_parent_signal, parent))
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, _PARENT_GONE)
    try:
        if os.getppid() != parent:
            raise _ParentGone  # it died before the prctl: start nothing
        child = _start(cmd)
        status = _wait_for(child.pid)
    except OSError as e:  # not found, not executable: as a shell says it
        logger.error("cannot run %s: %s", cmd[0], e)
        os._exit(127)
    except _ParentGone:
        signal.signal(_PARENT_GONE, signal.SIG_IGN)
        logger.warning("pid %d that started %s died: stopping its process tree", parent, cmd[0])
        _stop_tree_and_clean(_GRACE_S, scratch)
        os._exit(1)
    for signum in (_PARENT_GONE, *_FORWARDED):  # the command exited: its leftovers go either way
        signal.signal(signum, signal.SIG_IGN)
    _stop_tree_and_clean(_LEFTOVER_GRACE_S, scratch)
    _exit_like(status)


if __name__ == "__main__":
    main(sys.argv[1:])
