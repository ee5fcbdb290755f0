"""``make test``'s worker groups hold: under ``pytest -n 2 --dist loadgroup`` the tests of one file run
on one worker, and so do the tests of different files that share the session's vLLM server.

``tests/conftest.py`` groups by an ``xdist_group`` mark that pytest-xdist turns into a suffix of each
test's node id; with pytest 9.2 that suffix no longer takes (pytest-xdist issue #1386), and nothing
fails: the tests spread over both workers, every module fixture starts on each, and the session's
servers twice (one more vLLM server in memory beside the e2e runs). This runs a small suite through
the real hook in a subprocess and reads which worker ran each test.
"""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
import os
import pytest
from tests.conftest import pytest_collection_modifyitems  # the hook under test

@pytest.fixture(scope="session")
def vllm_server():
    return "a stand-in for the session's server"

@pytest.fixture
def record(request):
    yield
    with open(os.environ["WORKERS_FILE"], "a") as f:
        f.write(f"{request.node.nodeid} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""

ONE_FILE = "\n".join(f"def test_{i}(record): pass" for i in range(6))
SERVER_USER = "\n".join(f"def test_{i}(record, vllm_server): pass" for i in range(3))


def test_a_files_tests_and_the_servers_users_each_run_on_one_worker(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_one_file.py").write_text(ONE_FILE)
    (suite / "test_server_a.py").write_text(SERVER_USER)
    (suite / "test_server_b.py").write_text(SERVER_USER)
    workers_file = tmp_path / "workers.txt"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q", str(suite)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "WORKERS_FILE": str(workers_file)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    workers = defaultdict(set)
    for line in workers_file.read_text().splitlines():
        nodeid, worker = line.split()
        group = "server" if "test_server_" in nodeid else Path(nodeid.split("::")[0]).name
        workers[group].add(worker)
    assert sum(1 for _ in workers_file.read_text().splitlines()) == 12
    for group in ("server", "test_one_file.py"):
        assert len(workers[group]) == 1, f"{group}: ran on {sorted(workers[group])} (pytest {pytest.__version__})"
