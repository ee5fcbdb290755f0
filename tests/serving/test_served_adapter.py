"""The LoRA adapter the run serves is one fact, on the :class:`~megarl.serving.servers.ServerSet`: the
rollout side's requests and the trainer's probes read it there (adapter weight sync sets it once every
server loaded a version). The probe's trajectories are asked in the family's generation dialect, as the
rollout side asks."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from megarl.api import ModelRequest
from megarl.api.io_struct import GenerationHyperparameters
from megarl.serving import make_control
from tests.rollout.conftest import make_engine
from tests.rollout.helpers import expected_tokens

ADAPTER = "megarl-lora-v3"
ASKS_FOR = {"vllm": "model", "sglang": "lora_path"}
"""Where each family's request names the LoRA adapter it asks for."""


def _payloads(address: str) -> list[dict]:
    with urllib.request.urlopen(f"http://{address}/_stats", timeout=10) as resp:
        return json.loads(resp.read())["payloads"]


def _generate(engine) -> None:
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=4)
    asyncio.run(engine.agenerate(ModelRequest(input_ids=[101, 102, 103], gconfig=gconfig)))


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_requests_ask_for_the_adapter_the_server_set_serves(fake_servers, dialect):
    (server,) = fake_servers(1, dialect=dialect)
    engine = make_engine([server.address], backend=dialect)
    try:
        _generate(engine)
        engine.use_adapter(ADAPTER)  # what the weight sync calls once every server loaded the version
        assert engine.servers.adapter == ADAPTER
        _generate(engine)
        engine.use_adapter(None)
        _generate(engine)
    finally:
        engine.destroy()
    assert [p.get(ASKS_FOR[dialect]) for p in _payloads(server.address)] == [None, ADAPTER, None]


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_probe_trajectories_are_asked_in_the_familys_dialect(fake_servers, dialect):
    (server,) = fake_servers(1, dialect=dialect)
    control = make_control(dialect, server.address, tp=1, timeout=30)
    prompt = [101, 102, 103, 104]
    out = control.generate(prompt, 6, seed=5, adapter=ADAPTER)
    assert out == prompt + expected_tokens(len(prompt), 6)[0]
    (payload,) = _payloads(server.address)
    assert payload == control.dialect().generate_payload(
        prompt, GenerationHyperparameters(max_new_tokens=6, min_new_tokens=6, seed=5), 6, 6, ADAPTER
    )
    assert payload[ASKS_FOR[dialect]] == ADAPTER
