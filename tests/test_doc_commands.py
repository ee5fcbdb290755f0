"""Every command a page tells a newcomer to type runs, in a fresh shell with only the README's set-up done.

The README's set-up is ``make run`` (or ``make install``), which builds ``.venv``, and "activate it
first (``source .venv/bin/activate``)". So each shell block of README.md and docs/ runs in a shell
that has the venv activated and nothing else of this process's environment (no ``PATH`` with the
venv in it, no ``VIRTUAL_ENV``): a page whose command needs more must say so. ``megarl run ARGS``
runs as ``megarl run --check ARGS`` (the config, its files and datasets, the reward's first call, where
each process goes: everything before a process starts; the runs themselves are the main job's, the
learning benchmarks' and the slow tests'). ``megarl config``, ``allocation``, ``plan`` and
``models list`` and ``slurm --dry-run`` run as written.

A block that cannot run here (a GPU, a cluster, a benchmark of minutes, a run's directory, a
placeholder path) says why in a comment on the line above its fence, which the site does not show::

    <!-- not run by the docs test: needs a GPU -->

and a block that shows a refusal says so (it must fail with megarl's error)::

    <!-- the docs test expects an error -->
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_FENCES = ("bash", "sh", "shell", "console")
MARKER = re.compile(r"<!-- not run by the docs test: (?P<why>\S.*?) -->")
REFUSED = "<!-- the docs test expects an error -->"
"""Above a block that shows a refusal: it must fail, with megarl's one-line error."""
RUNNABLE = (
    "megarl run ",
    "megarl config ",
    "megarl allocation ",
    "megarl plan ",
    "megarl models list",
    "megarl slurm --dry-run ",
)
KEPT_ENV = ("HOME", "LANG", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "MEGARL_CACHE")
"""What the fresh shell keeps of this process's environment: the user's home and the caches that
``make run`` filled (models, datasets); nothing that puts the venv on the path."""


@dataclass
class Block:
    page: Path
    line: int
    commands: list[str]
    skip_reason: str | None
    refused: bool = False

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def shell_blocks(page: Path) -> list[Block]:
    """The page's shell blocks: their commands (continuation lines joined, comments dropped) and the
    reason on the line above the fence, if any."""
    text = page.read_text()
    blocks = []
    for fence in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if fence.group(1) not in SHELL_FENCES:
            continue
        above = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.fullmatch(above.strip())
        line = text[: fence.start()].count("\n") + 1
        commands = _commands(fence.group(2))
        blocks.append(Block(page, line, commands, marker["why"] if marker else None, above.strip() == REFUSED))
    return blocks


def _commands(body: str) -> list[str]:
    joined = re.sub(r"\s*\\\n\s*", " ", body)
    lines = (re.sub(r"(^|\s)#[^'\"]*$", "", line).strip() for line in joined.splitlines())  # a trailing comment
    return [line for line in lines if line]


def as_checked(command: str) -> str:
    """``megarl run ARGS`` becomes ``megarl run --check ARGS``; the other runnable commands stay."""
    return "megarl run --check " + command.removeprefix("megarl run ") if command.startswith("megarl run ") else command


def fresh_shell(script: str, activate: bool = True) -> subprocess.CompletedProcess:
    """``script`` in a new bash at the repository's root, with the venv activated (``activate``) and only
    :data:`KEPT_ENV` of this environment."""
    env = {key: os.environ[key] for key in KEPT_ENV if key in os.environ}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    setup = f"source {shlex.quote(str(Path(sys.prefix) / 'bin' / 'activate'))}\n" if activate else ""
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", setup + script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


BLOCKS = [block for page in PAGES for block in shell_blocks(page)]
TO_RUN = [block for block in BLOCKS if block.skip_reason is None]


def test_every_shell_block_runs_here_or_says_why_not():
    unrunnable = [
        f"{block.where}: `{command}`"
        for block in TO_RUN
        for command in block.commands
        if not command.startswith(RUNNABLE)
    ]
    assert not unrunnable, (
        "these commands cannot run in the docs test; if they cannot run on a CPU machine in a minute, put "
        "`<!-- not run by the docs test: why -->` on the line above their block:\n" + "\n".join(unrunnable)
    )
    assert len(TO_RUN) >= 25, f"only {len(TO_RUN)} of {len(BLOCKS)} shell blocks run: most should"


@pytest.mark.parametrize("block", TO_RUN, ids=[block.where for block in TO_RUN])
def test_the_block_runs_in_a_fresh_shell(block):
    done = fresh_shell("\n".join(as_checked(command) for command in block.commands))
    output = f"{block.where}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if block.refused:
        assert done.returncode != 0 and "error: config error at" in done.stderr, output
    else:
        assert done.returncode == 0, output


def test_a_fresh_shell_has_no_megarl_until_the_venv_is_activated():
    """What makes the test above a check of the pages: the shell gets megarl from the activation the
    README asks for, not from this process's environment."""
    done = fresh_shell("megarl --help", activate=False)
    assert done.returncode == 127 and "megarl: command not found" in done.stderr


def test_the_parser_finds_blocks_commands_and_reasons(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```bash\nmegarl run a.yaml \\\n  x=1   # note\nmegarl config --config a.yaml\n```\n\n"
        "<!-- not run by the docs test: needs a GPU -->\n```bash\nbash kit.sh\n```\n\n```python\nprint()\n```\n"
    )
    first, second = shell_blocks(page)
    assert first.commands == ["megarl run a.yaml x=1", "megarl config --config a.yaml"]
    assert first.skip_reason is None and second.skip_reason == "needs a GPU"
    assert as_checked(first.commands[0]) == "megarl run --check a.yaml x=1"
