"""The open-file limit (``RLIMIT_NOFILE``) a process needs for its connections.

Every socket is a file descriptor. A trainer head holds one per generation request in flight,
per control call to a server, per member of a weight-bridge group, besides its files. The soft
limit is what the kernel enforces; a process may raise it up to the hard limit itself, and only
the administrator raises the hard limit. A child inherits both.

:func:`ensure_open_files` raises the soft limit to what is needed and refuses, naming both
numbers, when the hard limit is below it: a run found short only once its connections fail
(``OSError: [Errno 24] Too many open files``) has lost its start-up by then.
"""

from __future__ import annotations

import logging

try:
    import resource
except ImportError:  # not on POSIX: no limit to raise
    resource = None

logger = logging.getLogger(__name__)

RAISE_HARD_LIMIT = (
    "raise the hard limit: `ulimit -Hn N` in a root shell (or `prlimit --nofile=N:N --pid PID`), "
    "'* hard nofile N' in /etc/security/limits.conf for new logins, LimitNOFILE=N in a systemd unit, "
    "`docker run --ulimit nofile=N:N` in a container; under Slurm the compute nodes' limit counts "
    "(the slurmd's own LimitNOFILE; `srun --propagate=NOFILE` carries the submitting shell's soft limit)"
)
"""How to raise the hard limit, for the error."""


class OpenFilesError(RuntimeError):
    """The hard ``RLIMIT_NOFILE`` is below the file descriptors a process needs."""

    def __init__(self, needed: int, soft: int, hard: int, what: str):
        self.needed, self.soft, self.hard, self.what = needed, soft, hard, what
        super().__init__(
            f"{what} needs {needed:,} open files, but this process may open at most {hard:,} "
            f"(RLIMIT_NOFILE hard limit {hard:,}, soft {soft:,}): {RAISE_HARD_LIMIT}"
        )


def open_files_limits() -> tuple[int, int]:
    """``(soft, hard)`` ``RLIMIT_NOFILE`` of this process; unlimited is ``RLIM_INFINITY`` (-1 on Linux)."""
    if resource is None:
        return -1, -1
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _unlimited(limit: int) -> bool:
    return resource is None or limit == resource.RLIM_INFINITY


def ensure_open_files(needed: int, what: str, refuse: bool = True) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to ``min(hard, max(soft, needed))``; the soft limit now.

    ``what`` names who needs them, for the error and the log. When the hard limit is below
    ``needed``: :class:`OpenFilesError` naming both (``refuse``), else the soft limit is raised to
    the hard one and a warning logged. Never lowers a limit.
    """
    soft, hard = open_files_limits()
    if resource is None or _unlimited(soft) or soft >= needed:
        return soft
    if not _unlimited(hard) and hard < needed:
        if refuse:
            raise OpenFilesError(needed, soft, hard, what)
        logger.warning(
            "%s needs %d open files; the hard limit RLIMIT_NOFILE here is %d: raising the soft limit %d to it",
            what,
            needed,
            hard,
            soft,
        )
        target = hard
    else:
        target = needed
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        logger.info("raised RLIMIT_NOFILE's soft limit from %d to %d (%s)", soft, target, what)
    return target
