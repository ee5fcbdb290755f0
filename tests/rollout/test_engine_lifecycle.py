"""RemoteInferenceEngine is built in one phase: its servers and client exist from ``initialize()`` on, and
before it a call that needs them says so; a version set before ``initialize()`` is the client's after."""

from __future__ import annotations

import pytest

from megarl.rollout import RemoteInferenceEngine
from tests.rollout.conftest import fast_config


def test_before_initialize_the_servers_are_not_there_and_say_so():
    engine = RemoteInferenceEngine(fast_config(), "vllm")
    for what in ("servers", "client"):
        with pytest.raises(RuntimeError, match=r"call initialize\(\) first"):
            getattr(engine, what)
    with pytest.raises(RuntimeError, match=r"call initialize\(\) first"):
        engine.pause()
    assert engine.tokenizer is None
    engine.destroy()  # nothing to stop: no error


def test_a_version_set_before_initialize_is_the_clients(fake_servers):
    (server,) = fake_servers(1)
    engine = RemoteInferenceEngine(fast_config(), "vllm")
    engine.set_version(3)
    assert engine.get_version() == 3
    engine.initialize(server_addrs=[server.address], batch_size=2)
    try:
        assert engine.client.get_version() == 3 and engine.get_version() == 3
        engine.set_version(4)
        assert engine.client.get_version() == 4
    finally:
        engine.destroy()


@pytest.mark.parametrize("ms, expected_s", [(0.2, 0.0002), (0.0, 0.005)])
def test_the_pool_shortens_the_interpreters_switch_interval(fake_servers, ms, expected_s):
    """The pool's loop thread gets the interpreter lock back after each socket call within
    ``rollout.switch_interval_ms`` (0.2 ms by default) while the trainer's Python holds it; 0 leaves
    the interpreter's 5 ms (with it the loop fell 0.46 s behind at 8 simulated servers)."""
    import sys

    (server,) = fake_servers(1)
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    engine = RemoteInferenceEngine(fast_config(switch_interval_ms=ms), "vllm")
    try:
        engine.initialize(server_addrs=[server.address], batch_size=2)
        assert sys.getswitchinterval() == pytest.approx(expected_s)
    finally:
        engine.destroy()
        sys.setswitchinterval(saved)
