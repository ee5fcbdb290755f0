"""The launcher's console: every child's output line by line, prefixed with its name, and its log file.

:class:`OutputRelay` serves ``megarl run`` (:mod:`megarl.launcher.local`): the servers' and the
trainer's lines reach the console as they come (``[server-0] ...``, ``[trainer] ...``), a
partial line is finished before another child's line starts, and each child's bytes also go to
its log file under ``{run_dir}/logs``.
"""

from __future__ import annotations

import codecs
import threading
from pathlib import Path
from typing import IO, TextIO

_FOLLOW_POLL_S = 0.2


class OutputRelay:
    """Writes children's output to one stream: lines whole and prefixed ``[name]``, or passed through.

    ``verbose`` relays every process's whole output as prefixed lines (the servers' logs
    too). Otherwise only what the trainer prints to its console (:mod:`megarl.utils.console`)
    reaches ``out``, unprefixed: byte for byte on a terminal, so its progress bar redraws in
    place; elsewhere as lines, carriage returns ending them too.
    """

    def __init__(self, out: TextIO, verbose: bool = True):
        self._out = out
        self.verbose = verbose
        self.tty = hasattr(out, "isatty") and out.isatty()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._mid_line = False

    def line(self, name: str, text: str) -> None:
        with self._lock:
            self._write(f"[{name}] {text}\n" if self.verbose else text + "\n")

    def _write(self, text: str) -> None:
        if self._mid_line and not self.tty:
            text = "\n" + text
        self._out.write(text)
        self._out.flush()
        self._mid_line = not text.endswith("\n")

    def end_line(self) -> None:
        """Finish a line the trainer left open (its bar), so that what follows starts on its own."""
        with self._lock:
            if self._mid_line:
                self._out.write("\n")
                self._out.flush()
                self._mid_line = False

    def console(self, name: str, stream: IO[bytes], log: IO[bytes]) -> threading.Thread:
        """Relay the trainer's console output (until EOF), see the class docstring; its lines go to ``log`` too."""

        def pump() -> None:
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            pending = ""
            while chunk := stream.read1(65536):
                text = decoder.decode(chunk)
                *lines, pending = (pending + text).split("\n")
                # a line is what its last carriage return left (a bar's final state), blank ones are dropped
                lines = [line.rsplit("\r", 1)[-1] for line in lines]
                lines = [line + "\n" for line in lines if line.strip()]
                log.write("".join(lines).encode())
                log.flush()
                if not self.tty:  # whole lines only, bars too: a carriage return ends one
                    text = "".join(lines)
                    *bar_frames, pending = pending.split("\r")
                    text += "".join(frame + "\n" for frame in bar_frames if frame.strip())
                if text:
                    with self._lock:
                        self._write(text)
            if pending.strip():
                log.write(pending.encode() + b"\n")
                self.line(name, pending)

        return self._spawn(pump, name)

    def pipe(self, name: str, stream: IO[bytes], log: IO[bytes]) -> threading.Thread:
        """Relay ``stream`` (until EOF) to the console and to ``log``."""

        def pump() -> None:
            for raw in stream:
                log.write(raw)
                log.flush()
                self.line(name, raw.decode(errors="replace").rstrip("\n"))

        return self._spawn(pump, name)

    def follow(self, name: str, path: Path) -> threading.Thread:
        """Relay the lines appended to ``path`` from now on, until :meth:`close`."""
        start = path.stat().st_size if path.exists() else 0

        def tail() -> None:
            while not path.exists():
                if self._stop.wait(_FOLLOW_POLL_S):
                    return
            with open(path, "rb") as f:
                f.seek(start)
                pending = b""
                while True:
                    pending += f.readline()
                    if pending.endswith(b"\n"):
                        self.line(name, pending.decode(errors="replace").rstrip("\n"))
                        pending = b""
                    elif self._stop.wait(_FOLLOW_POLL_S):
                        break
                rest = pending + f.read()
                for text in rest.decode(errors="replace").splitlines():
                    self.line(name, text)

        return self._spawn(tail, name)

    def _spawn(self, target, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=f"relay-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def close(self, timeout: float = 5.0) -> None:
        """Flush what followed files still hold and stop following them."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        self._threads.clear()
        self._stop.clear()
