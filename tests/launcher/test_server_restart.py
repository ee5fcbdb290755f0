"""``megarl run`` restarts a dead server in its slot, within ``launcher.server_restarts`` /
``launcher.max_server_restarts``, then fails the run naming the budget spent."""

from __future__ import annotations

import json
import sys

import pytest

from megarl.config.base import ConfigError
from megarl.config.run import LauncherConfig
from megarl.launcher.server_health import ServerRestarts, check_servers
from megarl.serving.launch import InferenceServer, LaunchSpec, ServerLaunchError
from megarl.serving.restarts import RESTARTS_FILE, RestartLog


def _server(tmp_path, name: str, port: int) -> InferenceServer:
    spec = LaunchSpec([sys.executable, "-c", "import time; time.sleep(60)"], {"MEGARL_LAUNCH_TAG": name}, port=port)
    return InferenceServer(spec, tmp_path / f"{name}.log", name=name).start()


def _die(server: InferenceServer) -> None:
    server.proc.kill()
    server.proc.wait()


def test_a_dead_server_restarts_in_its_slot_until_the_budget_is_spent(tmp_path):
    servers = [_server(tmp_path, "server-0", 1111), _server(tmp_path, "server-1", 2222)]
    restarts = ServerRestarts(per_server=2, per_run=3, run_dir=tmp_path)
    log = RestartLog(tmp_path, poll_s=0.0)
    try:
        first = servers[0]
        _die(first)
        check_servers(servers, "during training", restarts)
        assert servers[0] is not first and servers[0].proc.poll() is None, "a new process in the slot"
        assert servers[0].address == first.address and servers[0].spec.env == first.spec.env
        assert servers[1].proc.poll() is None
        assert log.new_addresses() == ["127.0.0.1:1111"], "the trainer learns of the restart"
        _die(servers[0])
        check_servers(servers, "during training", restarts)
        _die(servers[0])
        with pytest.raises(ServerLaunchError, match=r"not restarted: launcher.server_restarts=2 restarts of server-0"):
            check_servers(servers, "during training", restarts)
        others = servers[1:]  # (the run would have ended: go on with server-1 alone)
        _die(others[0])
        check_servers(others, "during training", restarts)  # the run's third
        servers[1] = others[0]
        _die(servers[1])
        with pytest.raises(ServerLaunchError, match=r"launcher.max_server_restarts=3 restarts of this run are spent"):
            check_servers(others, "during training", restarts)
    finally:
        for server in servers:
            server.stop(timeout=2)
    lines = [json.loads(line) for line in (tmp_path / RESTARTS_FILE).read_text().splitlines()]
    assert [(r["server"], r["restart"], r["run_total"]) for r in lines] == [
        ("server-0", 1, 1),
        ("server-0", 2, 2),
        ("server-1", 1, 3),
    ]
    assert "restarting it in its slot" in (tmp_path / "server-0.log").read_text()


def test_no_restart_budget_fails_as_before(tmp_path):
    servers = [_server(tmp_path, "server-0", 1111)]
    _die(servers[0])
    with pytest.raises(ServerLaunchError, match="launcher.server_restarts=0 restarts of server-0 are spent"):
        check_servers(servers, "during training", ServerRestarts(0, 10, tmp_path))


def test_restart_budgets_are_checked():
    with pytest.raises(ConfigError, match="server_restarts"):
        LauncherConfig(server_restarts=-1).check()
    with pytest.raises(ConfigError, match="max_server_restarts"):
        LauncherConfig(max_server_restarts=-1).check()


def test_restart_log_reads_whole_new_lines_only(tmp_path):
    path = tmp_path / RESTARTS_FILE
    path.write_text(json.dumps({"address": "h:1"}) + "\n")
    log = RestartLog(tmp_path, poll_s=0.0)  # what was there before the trainer started is done
    with open(path, "a") as f:
        f.write(json.dumps({"address": "h:2"}) + "\n" + '{"address": "h:')
    assert log.new_addresses() == ["h:2"]
    with open(path, "a") as f:
        f.write('3"}\n')
    assert log.new_addresses() == ["h:3"]
    assert log.new_addresses() == []
