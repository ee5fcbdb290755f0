"""Process-tree termination, kill-on-exit registration and the leftovers of a dead child (no orphaned servers)."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass

import psutil

logger = logging.getLogger(__name__)

_POLL_S = 0.02
_KILL_WAIT_S = 5.0  # SIGKILL cannot be ignored; this only bounds a stuck-in-kernel process


def _is_gone(proc: psutil.Process) -> bool:
    """Exited, or a zombie (dead, waiting for a parent that may never reap it)."""
    try:
        # is_running() is False when the pid now belongs to a different process.
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds; return the processes still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if not _is_gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        alive = [p for p in alive if not _is_gone(p)]
    return alive


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)  # psutil refuses if the pid was reused meanwhile
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
        except psutil.AccessDenied:
            logger.warning("no permission to send signal %s to pid %d", sig, proc.pid)


def _snapshot(root_pid: int, include_parent: bool) -> tuple[list[psutil.Process], int | None]:
    """The tree below (and with) ``root_pid``, and its process group if it leads one."""
    try:
        root = psutil.Process(root_pid)
        procs = root.children(recursive=True) + ([root] if include_parent else [])
        leads_group = include_parent and os.getpgid(root_pid) == root_pid != os.getpgrp()
    except (psutil.NoSuchProcess, ProcessLookupError):
        return [], None
    return procs, root_pid if leads_group else None


def _signal_group(pgid: int | None, sig: int) -> list[psutil.Process]:
    """Signal the process group; return its members (to wait for)."""
    if pgid is None:
        return []
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return []  # the group is empty by now
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except ProcessLookupError:
            pass
    return members


def terminate_process_tree(
    pid: int | subprocess.Popen,
    timeout: float = 10.0,
    sig: int = signal.SIGTERM,
    include_parent: bool = True,
) -> None:
    """Stop a process and all its descendants; SIGKILL whatever outlives ``timeout``.

    The tree is captured before any signal, so descendants that get re-parented when
    their parent dies are still reached. Children are signalled before the parent.
    When the root leads its own process group (``Popen(start_new_session=True)``, as
    servers should be started) the group gets the signals too, which also catches
    processes forked after the capture; those get SIGKILL once the captured tree is
    down. Processes already gone are not an error; zombies count as gone. Children of
    this process are left to their owner to reap (reaping here would steal the exit
    status from a ``Popen`` holding the pid), except when ``pid`` is itself a ``Popen``.

    Args:
        pid: Root process id, or the ``Popen`` that started it (then it is also reaped,
            so ``popen.returncode`` is set).
        timeout: Seconds to wait after ``sig`` before SIGKILL.
        sig: First signal to send.
        include_parent: False stops only the descendants of ``pid``.
    """
    popen = pid if isinstance(pid, subprocess.Popen) else None
    root_pid = popen.pid if popen is not None else int(pid)
    if include_parent and root_pid == os.getpid():
        raise ValueError(
            f"terminate_process_tree: pid {root_pid} is this process; "
            "pass include_parent=False to stop only its children"
        )
    if popen is not None and popen.returncode is not None:
        return  # already reaped: the pid may belong to someone else by now
    procs, pgid = _snapshot(root_pid, include_parent)
    _signal_all(procs, sig)
    _signal_group(pgid, sig)
    alive = _wait_gone(procs, timeout)
    if alive:
        pids = [p.pid for p in alive]
        logger.warning("pids %s survived signal %s for %.1fs; killing", pids, sig, timeout)
        _signal_all(alive, signal.SIGKILL)
    alive = _wait_gone(alive + _signal_group(pgid, signal.SIGKILL), _KILL_WAIT_S)
    if alive:
        logger.error("pids %s survived SIGKILL", [p.pid for p in alive])
    if popen is not None and include_parent:
        try:
            popen.wait(timeout=_KILL_WAIT_S)  # reap through Popen so its returncode is set
        except subprocess.TimeoutExpired:
            logger.error("pid %d did not exit", root_pid)


class _ExitCleanup:
    """Process trees to terminate when this interpreter exits or is told to stop.

    One per process (atexit and signal handlers are process-wide by nature).
    """

    def __init__(self) -> None:
        # Re-entrant: the signal handler runs on the main thread, maybe inside add().
        self._lock = threading.RLock()
        self._procs: dict[int, tuple[psutil.Process, float]] = {}
        self._installed = False

    def add(self, pid: int, timeout: float) -> None:
        proc = psutil.Process(pid)  # remembers the create time, so a reused pid is skipped
        with self._lock:
            self._procs[pid] = (proc, timeout)
            if not self._installed:
                self._install()

    def remove(self, pid: int) -> None:
        with self._lock:
            self._procs.pop(pid, None)

    def _install(self) -> None:
        atexit.register(self.run)
        if threading.current_thread() is not threading.main_thread():
            logger.warning("kill_on_exit first used off the main thread: only atexit covers it")
        else:
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous = signal.getsignal(signum)
                signal.signal(signum, self._make_handler(previous))
        self._installed = True

    def run(self) -> None:
        """Terminate every registered tree whose root still runs (reused pids are skipped)."""
        with self._lock:
            entries, self._procs = list(self._procs.values()), {}
        for proc, timeout in entries:
            if proc.is_running():
                logger.info("terminating process tree of pid %d at exit", proc.pid)
                terminate_process_tree(proc.pid, timeout=timeout)

    def _make_handler(self, previous):
        def handler(signum, frame):
            self.run()
            if callable(previous):
                previous(signum, frame)  # e.g. KeyboardInterrupt for SIGINT
            elif previous != signal.SIG_IGN:
                # Default action: die by this signal, as the caller expects.
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        return handler


_EXIT_CLEANUP = _ExitCleanup()


def kill_on_exit(proc: int | subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate ``proc``'s whole tree when this process exits or gets SIGTERM/SIGINT.

    The first call installs an atexit hook and (from the main thread) SIGTERM/SIGINT
    handlers that chain to the previous ones.
    """
    _EXIT_CLEANUP.add(proc.pid if isinstance(proc, subprocess.Popen) else int(proc), timeout)


def cancel_kill_on_exit(proc: int | subprocess.Popen) -> None:
    """Forget ``proc`` (e.g. after stopping it deliberately)."""
    _EXIT_CLEANUP.remove(proc.pid if isinstance(proc, subprocess.Popen) else int(proc))


LAUNCH_TAG_ENV = "MEGARL_LAUNCH_TAG"
"""Set in every process of one launched child (:class:`LaunchMark`)."""
_ORPHAN_GRACE_S = 3.0
_ORPHAN_KILL_WAIT_S = 10.0  # a killed process with much memory takes a while to go


@dataclass(frozen=True)
class LaunchMark:
    """Finds the processes of one launched child (started in its own session) after it died.

    ``terminate_process_tree`` reaches a live tree, but a child that exited first left its
    children re-parented to init, out of its tree: the engine core and workers of a dead
    vLLM server (still in the server's process group; their environment is unreadable
    as ``setproctitle`` overwrites it), or the workers of a rank the OOM killer took
    (torchrun starts ranks in sessions of their own; they hold the trainer's output
    pipe open). So a leftover is any process in the child's process group or carrying
    its tag in its environment (:attr:`env`), younger than the launch (which rules out
    recycled pids).
    """

    tag: str
    since: float

    @staticmethod
    def new() -> LaunchMark:
        return LaunchMark(uuid.uuid4().hex, time.time() - 2.0)  # psutil's create_time is exact to about 1 s

    @property
    def env(self) -> dict[str, str]:
        return {LAUNCH_TAG_ENV: self.tag}

    def leftovers(self, pgid: int) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid == os.getpid() or proc.create_time() < self.since or _is_gone(proc):
                    continue
                if os.getpgid(proc.pid) == pgid or _environ(proc).get(LAUNCH_TAG_ENV) == self.tag:
                    found.append(proc)
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        return found


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except psutil.AccessDenied:
        return {}


def stop_leftovers(pgid: int, mark: LaunchMark) -> None:
    """Kill what the child leading process group ``pgid`` left behind (see :class:`LaunchMark`).

    Orphaned vLLM processes may ignore SIGTERM and nobody is left to shut down
    gracefully for: a short grace, then SIGKILL.
    """
    procs = mark.leftovers(pgid)
    for sig, wait in ((signal.SIGTERM, _ORPHAN_GRACE_S), (signal.SIGKILL, _ORPHAN_KILL_WAIT_S)):
        if not procs:
            return
        logger.info("sending %s to pids %s, left behind by a stopped process", sig.name, [p.pid for p in procs])
        _signal_all(procs, sig)
        procs = _wait_gone(procs, wait)
    if procs:  # SIGKILL always wins; a starved CPU can slow the exit down
        logger.warning("pids %s are still exiting after SIGKILL", [p.pid for p in procs])
