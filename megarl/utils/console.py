"""What a person sees while a run goes: a few start-up lines, one progress bar, a line per step, the summary.

Everything else a trainer process prints (Megatron's and other libraries' output, warnings,
log records, the per-step stats tables) goes to ``{run_dir}/logs/trainer.log`` (rank N > 0:
``trainer-rankN.log``): :func:`open_console` points the process's file descriptors 1 and 2 there and keeps the
original standard output for the console. ``launcher.verbose`` keeps everything on the
console as before.

The console may be a terminal (the bar redraws in place) or a pipe or file (a CI log, a
Slurm output file): there the bar becomes a status line at most every
``STATUS_INTERVAL_S`` seconds. ``megarl run`` tells its trainer which one its own console is
(``$MEGARL_CONSOLE_TTY``), since the trainer's output reaches it through a pipe.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

CONSOLE_TTY_ENV = "MEGARL_CONSOLE_TTY"
"""``1`` when the console the trainer's output ends up on is a terminal (set by ``megarl run``)."""
STATUS_INTERVAL_S = 10.0
"""Seconds between two status lines when the console is not a terminal."""
STOP_FILE = "logs/stopped.txt"
"""Under the run directory: why the trainer stopped on an error of the user's code (e.g. a broken reward),
written by the trainer for the launcher, which then shows no stack of its own and does not restart it."""


def record_stop(run_dir: Path, reason: str) -> None:
    """Note under ``run_dir`` that the trainer stopped for ``reason`` (see :data:`STOP_FILE`)."""
    path = Path(run_dir) / STOP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(reason + "\n")


def take_stop(run_dir: Path) -> str | None:
    """The reason :func:`record_stop` noted under ``run_dir``, removing the note; None when there is none."""
    path = Path(run_dir) / STOP_FILE
    try:
        reason = path.read_text().strip()
    except FileNotFoundError:
        return None
    path.unlink(missing_ok=True)
    return reason


def console_is_tty(stream: TextIO) -> bool:
    """Whether ``stream``'s output ends up on a terminal (``$MEGARL_CONSOLE_TTY`` wins when set)."""
    forced = os.environ.get(CONSOLE_TTY_ENV)
    if forced is not None:
        return forced == "1"
    return hasattr(stream, "isatty") and stream.isatty()


class Console:
    """The console of one process: lines, and one progress bar at a time."""

    def __init__(self, stream: TextIO | None, tty: bool = False):
        self.stream, self.tty = stream, tty
        self._bar: Progress | None = None

    def line(self, text: str) -> None:
        """Print ``text`` (above the progress bar, if one is shown)."""
        if self.stream is None:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def progress(self, total: int, initial: int = 0, desc: str = "train") -> Progress:
        """The run's progress bar (closed by the caller)."""
        self._bar = Progress(self, total, initial, desc)
        return self._bar


class Progress:
    """A tqdm bar on a terminal; elsewhere a status line at most every ``STATUS_INTERVAL_S`` seconds."""

    def __init__(self, console: Console, total: int, initial: int, desc: str):
        self.console, self.total, self.n, self.desc = console, total, initial, desc
        self.status_text = ""
        self._start = self._last_status = time.monotonic()
        self._bar = None
        if console.stream is not None and console.tty:
            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit="step",
                file=console.stream,
                dynamic_ncols=True,
                mininterval=0.5,
            )

    def status(self, text: str) -> None:
        """Show ``text`` beside the bar (e.g. the rollout's progress within the step)."""
        self.status_text = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            if self._bar._time() - self._bar.last_print_t >= self._bar.mininterval:
                self._bar.refresh()
        elif time.monotonic() - self._last_status >= STATUS_INTERVAL_S:
            self._print_status()

    def advance(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)

    def write(self, text: str) -> None:
        """A permanent line above the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self.console.stream)
        elif self.console.stream is not None:
            self.console.stream.write(text + "\n")
            self.console.stream.flush()
            self._last_status = time.monotonic()  # a step line says as much as a status line

    def _print_status(self) -> None:
        elapsed = time.monotonic() - self._start
        self.console.stream.write(f"{self.desc} {self.n}/{self.total} [{_clock(elapsed)}] {self.status_text}\n")
        self.console.stream.flush()
        self._last_status = time.monotonic()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self.console._bar = None


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


def open_console(log_file: Path, rank: int, verbose: bool) -> Console:
    """This process's console; unless ``verbose``, its stdout and stderr now go to ``log_file``.

    Rank 0 keeps the original standard output as its console; other ranks have none.
    Redirecting the file descriptors, not ``sys.stdout``, also catches what C++ code and
    child processes print.
    """
    if verbose:
        return Console(sys.stdout if rank == 0 else None, console_is_tty(sys.stdout))
    tty = console_is_tty(sys.stdout)
    sys.stdout.flush()
    sys.stderr.flush()
    console_stream = os.fdopen(os.dup(1), "w", buffering=1) if rank == 0 else None
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    return Console(console_stream, tty)
