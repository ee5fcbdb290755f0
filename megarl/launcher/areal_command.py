"""AReaL's launch command by its own spelling: ``python -m megarl.launcher.local <script> --config <file>
[key=value ...]`` (``.slurm`` too) runs ``megarl run`` (``megarl slurm``) with the script as
``launcher.trainer_entry``. The ``megarl`` command line, which imports the launchers, runs in the process
this one becomes."""

from __future__ import annotations

import os
import sys

COMMANDS = {"local": "run", "slurm": "slurm"}
"""AReaL's launcher module -> the ``megarl`` command of the same launch."""


def megarl_argv(module: str, argv: list[str]) -> list[str] | None:
    """The ``megarl`` command line of AReaL's ``python -m areal.launcher.{module} <script> ...``; None
    without a script."""
    if not argv or argv[0].startswith("-"):
        return None
    script = os.path.abspath(argv[0]) if argv[0].endswith(".py") else argv[0]
    return [COMMANDS[module], *argv[1:], f"launcher.trainer_entry={script}"]


def main(module: str) -> None:
    """Become ``megarl <command> ...`` (no return), or print the usage and exit with status 2."""
    argv = megarl_argv(module, sys.argv[1:])
    if argv is None:
        print(f"usage: python -m megarl.launcher.{module} SCRIPT --config FILE [key=value ...]", file=sys.stderr)
        print(f"(megarl {COMMANDS[module]} --config FILE launcher.trainer_entry=SCRIPT: the same)", file=sys.stderr)
        sys.exit(2)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "megarl.launcher.cli", *argv])
