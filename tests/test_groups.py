"""``make test``'s worker groups hold: under ``pytest -n 2 --dist loadgroup`` the tests of one file run
on one worker, and so do the tests of different files that use the session's vLLM servers, which
stop after the last of them.

``tests/conftest.py`` groups by an ``xdist_group`` mark that pytest-xdist turns into a suffix of each
test's node id; with pytest 9.2 that suffix no longer takes (pytest-dev/pytest-xdist#1386), and
nothing fails: the tests spread over both workers, every module fixture starts on each, and the
session's servers twice. These run a small suite through the real hooks in a subprocess, with a
stand-in for the server, and read which worker ran each test and when the server stopped.
"""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
import contextlib, os
import pytest
from tests.conftest import (  # the hooks under test, and the session's servers with a stand-in server
    SERVERS_KEY, SessionServers, pytest_collection_modifyitems, pytest_runtest_teardown, vllm_server,
)

def log(line):
    with open(os.environ["LOG_FILE"], "a") as f:
        f.write(f"{line} {os.environ.get('PYTEST_XDIST_WORKER', 'main')}\\n")

@contextlib.contextmanager
def stand_in(model_dir, log_dir, dtype):
    log("start")
    yield f"a {dtype} server"
    log("stop")

@pytest.fixture(scope="session")
def session_servers(request, tmp_path_factory):
    servers = request.config.stash[SERVERS_KEY] = SessionServers("model", tmp_path_factory, serve=stand_in)
    yield servers
    servers.stop()

@pytest.fixture
def record(request):
    yield
    log(request.node.nodeid.split("@")[0])
"""

FILES = {
    "test_one_file.py": "\n".join(f"def test_{i}(record): pass" for i in range(6)),
    "test_server_a.py": "\n".join(f"def test_{i}(record, vllm_server): pass" for i in range(3)),
    "test_server_b.py": "\n".join(f"def test_{i}(record, vllm_server): pass" for i in range(3)),
    "test_z_after.py": "def test_after(record): pass",
}


def run_suite(tmp_path: Path, *args: str) -> list[tuple[str, str]]:
    """Run the suite with ``pytest ARGS``; its (event or test file, worker) lines in order."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name, text in FILES.items():
        (suite / name).write_text(text)
    log_file = tmp_path / "log.txt"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q", str(suite)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "LOG_FILE": str(log_file)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.rsplit(" ", 1) for line in log_file.read_text().splitlines()]
    return [(Path(what.split("::")[0]).name, worker) for what, worker in lines]


def test_a_files_tests_and_the_servers_users_each_run_on_one_worker(tmp_path):
    workers = defaultdict(set)
    for what, worker in run_suite(tmp_path, "-n", "2", "--dist", "loadgroup"):
        workers["server" if what.startswith("test_server_") else what].add(worker)
    for group in ("server", "test_one_file.py"):
        assert len(workers[group]) == 1, f"{group}: ran on {sorted(workers[group])} (pytest {pytest.__version__})"


def test_the_servers_stop_after_the_last_test_that_uses_them(tmp_path):
    events = [what for what, _ in run_suite(tmp_path, "-p", "no:xdist")]
    assert events.count("start") == 1 and events.count("stop") == 1, events
    users = [i for i, what in enumerate(events) if what.startswith("test_server_")]
    assert events.index("stop") == users[-1] + 1 < events.index("test_z_after.py"), events
