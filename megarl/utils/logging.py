"""Logging setup for the ``megarl`` logger hierarchy (console and optional file)."""

from __future__ import annotations

import logging
import os
import sys
import time

logger = logging.getLogger(__name__)

ROOT_LOGGER = "megarl"
_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
# Set on the handlers setup_logging installs, so a second call replaces exactly those.
_MARK = "_megarl_handler"


def _level_number(level: str | int) -> int:
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str):
        number = logging.getLevelNamesMapping().get(level.upper())
        if number is not None:
            return number
    names = ", ".join(sorted(logging.getLevelNamesMapping()))
    raise ValueError(f"setup_logging: unknown log level {level!r} (one of {names})")


def _stderr_is_tty() -> bool:
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def _console_handler(prefix: str) -> logging.Handler:
    """Rich output for people at a terminal; plain lines for files, pipes and Slurm logs."""
    if _stderr_is_tty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(
            console=Console(stderr=True), show_path=False, log_time_format=_DATE_FORMAT
        )
        handler.setFormatter(logging.Formatter(f"{prefix}%(name)s: %(message)s"))
        return handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_plain_formatter(prefix))
    return handler


def _plain_formatter(prefix: str) -> logging.Formatter:
    fmt = f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"
    return logging.Formatter(fmt, datefmt=_DATE_FORMAT)


def setup_logging(
    level: str | int = "INFO",
    rank: int | None = None,
    log_file: str | None = None,
    console_level: str | int | None = None,
) -> logging.Logger:
    """Configure the ``megarl`` logger: console output, optional file, rank prefix.

    Idempotent: a second call replaces the handlers of the first instead of adding
    more. The ``megarl`` logger stops propagating to the root logger so libraries that
    configure the root (vLLM, Ray) do not print our records twice.

    Args:
        level: Level name ("DEBUG", "INFO", ...) or number.
        rank: When given, every line starts with ``[rank N]``.
        log_file: Also append plain-text records to this file.
        console_level: Only records at this level or above reach the console (default: ``level``).

    Returns:
        The ``megarl`` logger.
    """
    number = _level_number(level)
    prefix = f"[rank {rank}] " if rank is not None else ""
    root = logging.getLogger(ROOT_LOGGER)
    for handler in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(handler)
        handler.close()
    handlers = [_console_handler(prefix)]
    if console_level is not None:
        handlers[0].setLevel(_level_number(console_level))
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
        handlers[-1].setFormatter(_plain_formatter(prefix))
    for handler in handlers:
        setattr(handler, _MARK, True)
        root.addHandler(handler)
    root.setLevel(number)
    root.propagate = False
    return root


def close_log_file() -> None:
    """Detach and close the file handler ``setup_logging`` added, keeping the console one.

    The launcher calls this when a run ends, so a process that starts runs in turn (the tests,
    a notebook) does not keep writing into an earlier run's directory.
    """
    root = logging.getLogger(ROOT_LOGGER)
    for handler in [h for h in root.handlers if getattr(h, _MARK, False) and isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` inside the ``megarl`` hierarchy (prefixed unless already)."""
    if name != ROOT_LOGGER and not name.startswith(ROOT_LOGGER + "."):
        name = f"{ROOT_LOGGER}.{name}"
    return logging.getLogger(name)


def is_rank0() -> bool:
    """Whether this process logs for the run: not a trainer rank other than 0 (``RANK`` unset counts as 0)."""
    return os.environ.get("RANK", "0") == "0"


class WarnOnce:
    """A warning logged the first time it is called only (``warn(msg, *args)``), for a condition that
    would otherwise repeat with every episode or call; one per object that owns it."""

    def __init__(self, log: logging.Logger):
        self.log, self.said = log, False

    def __call__(self, msg: str, *args) -> None:
        if not self.said:
            self.said = True
            self.log.warning(msg, *args)


class LogEvery:
    """A message logged at most once every ``seconds`` per key (``log(key, level, msg, *args)``), for a
    condition that repeats with every call: a service that keeps failing, a kind of failure worth one
    example now and then."""

    def __init__(self, log: logging.Logger, seconds: float):
        self.log, self.seconds = log, seconds
        self._last: dict[str, float] = {}

    def __call__(self, key: str, level: int, msg: str, *args) -> bool:
        """Log unless ``key`` was logged less than ``seconds`` ago; whether it logged."""
        now = time.monotonic()
        if now - self._last.get(key, -self.seconds) < self.seconds:
            return False
        self._last[key] = now
        self.log.log(level, msg, *args)
        return True
