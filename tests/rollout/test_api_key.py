"""A closed control plane (issue 20): a real vLLM-CPU server started with the run's key refuses every
request without it (401), the development routes included, and its weights stay as they were;
megarl's own clients (control calls, the pool's session) carry the key and are served."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from megarl.config.rollout import VLLMConfig
from megarl.rollout import InferenceServer, vllm_launch_spec
from megarl.serving.control import http_json
from megarl.serving.http import make_session
from megarl.utils.auth import API_KEY_ENV, INSECURE_ENV, RequireApiKey, auth_headers
from megarl.utils.network import find_free_ports

PROMPT = {"prompt": [1, 422, 2431, 314], "max_tokens": 4, "temperature": 0, "logprobs": 1}
GUARDED = [  # (method, route, body): what an outsider on the network would try
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", PROMPT),
    ("POST", "/pause?mode=abort", None),
    ("POST", "/resume", None),
    ("POST", "/start_weight_update", None),
    ("POST", "/update_weights", {"update_info": {"mode": "disk", "path": "/tmp/evil"}}),
    ("POST", "/finish_weight_update", {"weight_version": "666"}),
    ("POST", "/collective_rpc", {"method": "reset_prefix_cache"}),
]


def _status(address: str, method: str, route: str, body, headers: dict) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{address}{route}", data=data, method=method, headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def _greedy_logprobs(address: str) -> list[float]:
    reply = http_json(address, "/v1/completions", {"model": _model(address), **PROMPT}, timeout=60)
    return reply["choices"][0]["logprobs"]["token_logprobs"]


def _model(address: str) -> str:
    return http_json(address, "/v1/models", method="GET")["data"][0]["id"]


@pytest.fixture(scope="module")
def keyed_server(vllm_model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(API_KEY_ENV, "run-secret")
        port = find_free_ports(1)[0]
        spec = vllm_launch_spec(VLLMConfig(max_model_len=256, max_num_seqs=8), str(vllm_model_dir), "127.0.0.1", port)
        server = InferenceServer(spec, tmp_path_factory.mktemp("keyed") / "server.log", name="vllm-keyed").start()
        try:
            server.wait_until_healthy(600)
            yield server.address
        finally:
            server.stop()


@pytest.mark.vllm
def test_requests_without_the_key_are_refused_and_weights_stay(keyed_server, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "run-secret")
    before = _greedy_logprobs(keyed_server)  # megarl's control client carries the key
    for method, route, body in GUARDED:
        assert _status(keyed_server, method, route, body, {}) == 401, route
        assert _status(keyed_server, method, route, body, {"Authorization": "Bearer wrong"}) == 401, route
    assert _status(keyed_server, "GET", "/health", None, {}) == 200  # liveness stays open
    assert _greedy_logprobs(keyed_server) == before, "an unauthenticated request changed the server's weights"
    http_json(keyed_server, "/pause?mode=abort")  # the development routes answer megarl (a 401 would raise)
    http_json(keyed_server, "/resume")

    async def pool_session_completion() -> int:
        async with make_session(4) as session:
            async with session.post(
                f"http://{keyed_server}/v1/completions", json={"model": _model(keyed_server), **PROMPT}
            ) as reply:
                return reply.status

    assert asyncio.run(pool_session_completion()) == 200


def test_middleware_guards_all_but_health_and_opens_only_when_told_insecure(monkeypatch):
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    async def call(path: str, headers: list) -> list:
        sent = []

        async def send(message):
            sent.append(message)

        await RequireApiKey(app)({"type": "http", "method": "POST", "path": path, "headers": headers}, None, send)
        return sent

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(INSECURE_ENV, raising=False)
    assert auth_headers() == {}
    refused = asyncio.run(call("/pause", []))  # no key and not told insecure: closed, never a pass-through
    assert refused[0]["status"] == 401 and b"without an API key" in refused[1]["body"] and seen == []
    assert asyncio.run(call("/health", [])) == [] and seen == ["/health"]
    monkeypatch.setenv(INSECURE_ENV, "1")  # --insecure, in so many words
    assert asyncio.run(call("/pause", [])) == [] and seen == ["/health", "/pause"]
    monkeypatch.setenv(API_KEY_ENV, "k")  # a key wins over insecure
    refused = asyncio.run(call("/pause", [(b"authorization", b"Bearer x")]))
    assert refused[0]["status"] == 401 and seen == ["/health", "/pause"]
    assert (
        asyncio.run(call("/health", [])) == [] and asyncio.run(call("/pause", [(b"authorization", b"Bearer k")])) == []
    )
    assert seen == ["/health", "/pause", "/health", "/pause"] and auth_headers() == {"Authorization": "Bearer k"}


def test_the_run_key_is_saved_for_joining_servers_readable_by_its_owner_only(tmp_path, monkeypatch):
    from megarl.utils.auth import API_KEY_ENV, KEY_FILE, api_key, load_run_key, save_run_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    save_run_key(tmp_path)  # no key, no file
    assert not (tmp_path / KEY_FILE).exists()
    monkeypatch.setenv(API_KEY_ENV, "k1")
    save_run_key(tmp_path)
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o777 == 0o600
    monkeypatch.delenv(API_KEY_ENV)
    load_run_key(tmp_path)  # megarl serve --join
    assert api_key() == "k1"
    monkeypatch.setenv(API_KEY_ENV, "mine")
    load_run_key(tmp_path)  # a key of this process wins
    assert api_key() == "mine"
