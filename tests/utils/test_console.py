"""The run's console: a bar that redraws on a terminal; elsewhere whole lines, a status line at most every 10 s."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

from megarl.utils import console as console_mod
from megarl.utils.console import Console, console_is_tty


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_piped_console_prints_whole_lines_and_rate_limits_status(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(console_mod.time, "monotonic", clock)
    out = io.StringIO()
    con = Console(out, tty=False)
    bar = con.progress(total=3)
    for second in range(0, 35):  # a status update every second for 35 s
        clock.now = float(second)
        bar.status(f"rollout {second % 4}/4 groups")
    bar.write("step 1/3  reward 0.5")
    bar.advance()
    bar.close()
    con.line("megarl: finished")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    status = [line for line in lines if line.startswith("train ")]
    assert 3 <= len(status) <= 4, lines  # at most one per 10 s
    assert lines[-2:] == ["step 1/3  reward 0.5", "megarl: finished"]


def test_terminal_console_draws_a_bar_in_place():
    out = io.StringIO()
    con = Console(out, tty=True)
    bar = con.progress(total=2)
    bar.write("step 1/2  reward 0.5")
    bar.advance()
    bar.close()
    text = out.getvalue()
    assert "\r" in text and "step 1/2  reward 0.5\n" in text and "1/2 [" in text


def test_tty_env_wins(monkeypatch):
    monkeypatch.setenv("MEGARL_CONSOLE_TTY", "1")
    assert console_is_tty(io.StringIO())
    monkeypatch.setenv("MEGARL_CONSOLE_TTY", "0")
    assert not console_is_tty(sys.stdout)


def test_open_console_sends_everything_else_to_the_log(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, warnings
        from pathlib import Path
        from megarl.utils.console import open_console
        con = open_console(Path({str(tmp_path / "logs" / "trainer.log")!r}), rank=0, verbose=False)
        print("library chatter")
        warnings.warn("Apex is not installed")
        os.system("echo from a child process")
        con.line("step 1/1  reward 1.000")
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert result.stdout == "step 1/1  reward 1.000\n" and result.stderr == ""
    log = (tmp_path / "logs" / "trainer.log").read_text()
    assert "library chatter" in log and "Apex is not installed" in log and "from a child process" in log
