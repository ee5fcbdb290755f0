"""A Megatron actor updates real vLLM-CPU servers (TP 1 and TP 2) in broadcast, sharded and disk modes.

Each mode follows one optimizer step of the actor: before the update the servers'
logprobs of the probe measurably differ from the trainer's, after it they match within
bf16 tolerance. Trainer layouts: TP 2, and PP 2 (the second connects anew to the same
servers). The servers load megarl's receiver through the ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import logging

import pytest

from tests.actor.dist_utils import run_ranks

logger = logging.getLogger(__name__)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiproc]

MODES = ["broadcast", "sharded", "disk"]
BF16_TOLERANCE = 0.05  # max |dlogp| of bf16 Megatron vs bf16 vLLM on the probe tokens
MEASURABLE = 0.2  # one lr=1e-2 Adam step moves the probe logprobs by more than this


@pytest.mark.parametrize("alloc", ["megatron:d1p1t2", "megatron:d1p2t1"])
def test_actor_updates_vllm_servers(alloc, llama_servers, tmp_path):
    model_dir, servers = llama_servers
    results = sync_each_mode(model_dir, alloc, servers, tmp_path)
    logger.info("%s: %s", alloc, [(r["mode"], r["before"], r["after"]) for r in results[0]])
    for rank_result in results:
        assert_each_update_lands(rank_result, n_servers=len(servers))


def sync_each_mode(model_dir, alloc: str, servers: list, tmp_path, **options) -> list[list[dict]]:
    """Two trainer ranks in layout ``alloc``: one optimizer step and one update per mode of ``MODES``."""
    return run_ranks(
        2,
        "tests.bridge.workers:e2e_sync",
        timeout=900,
        model_dir=str(model_dir),
        alloc=alloc,
        servers=servers,
        modes=MODES,
        disk_dir=str(tmp_path / "disk"),
        **options,
    )


def assert_each_update_lands(rank_result: list[dict], n_servers: int) -> None:
    """Each mode's update, in order: the servers measurably behind before it, every one level after."""
    assert [r["mode"] for r in rank_result] == MODES
    for version, r in enumerate(rank_result, start=1):
        assert r["version"] == version
        assert r["before"]["logprob_diff_max"] > MEASURABLE, r
        assert r["after"]["logprob_diff_max"] < BF16_TOLERANCE, r
        for i in range(n_servers):
            assert r["after"][f"server{i}/logprob_diff_max"] < BF16_TOLERANCE, r


def test_a_compiled_server_loads_its_model_back(compiled_llama_server):
    """The second start of a compiled server on the same compile cache loads the model the first start compiled
    (vLLM 0.32 on CPU compiled it again at every start: ``megarl.serving.vllm_compile_cache``)."""
    _, _, (compiling_log, compiled_log) = compiled_llama_server
    assert "saved AOT compiled function" in compiling_log.read_text()
    second = compiled_log.read_text()
    assert "Directly load AOT compilation" in second
    assert "load failure" not in second


def test_actor_updates_a_compiled_vllm_server(compiled_llama_server, tmp_path):
    """A compiled server (``vllm.enforce_eager=false``, for long CPU runs), its model loaded back from the
    compile cache, serves each update's weights: its compiled graph reads the parameters the receiver wrote
    in place, not copies of them."""
    model_dir, servers, _ = compiled_llama_server
    results = sync_each_mode(model_dir, "megatron:d1p1t2", servers, tmp_path)
    logger.info("compiled: %s", [(r["mode"], r["before"], r["after"]) for r in results[0]])
    for rank_result in results:
        assert_each_update_lands(rank_result, n_servers=1)


def test_moe_actor_ep2_updates_vllm_server(moe_server, tmp_path):
    """Qwen3-MoE trained with EP 2 (each rank holds two experts) to a TP-2 vLLM server.

    Also guards the receiver's re-prepack of CPU experts after an update (vLLM 0.32 skips
    it; without it the served logprobs drift by ~0.5 after three steps).
    """
    model_dir, servers = moe_server
    results = sync_each_mode(model_dir, "megatron:d2p1t1e2", servers, tmp_path, threshold=0.1)
    logger.info("moe ep2: %s", [(r["mode"], r["before"], r["after"]) for r in results[0]])
    assert_each_update_lands(results[0], n_servers=1)


def test_pause_abort_resume_around_an_update(llama_servers):
    """In-flight generations are aborted by the update, continued after it, and their later tokens carry v1."""
    model_dir, servers = llama_servers
    address, tp = servers[0]
    (result,) = run_ranks(
        1, "tests.bridge.workers:pause_resume_sync", timeout=600, model_dir=str(model_dir), address=address, tp=tp
    )
    assert result["version"] == result["rollout_version"] == 1
    assert result["stats"]["logprob_diff_max"] < BF16_TOLERANCE
    responses = result["responses"]
    assert len(responses) == 4  # none lost
    assert any(r["interruptions"] >= 1 for r in responses)
    for r in responses:
        assert len(r["tokens"]) == len(r["versions"]) == 300 and r["stop"] == "length"
        assert r["versions"] == sorted(r["versions"]) and set(r["versions"]) <= {0, 1}
        if r["interruptions"]:
            assert r["versions"][-1] == 1  # continued on the new weights
    assert any(r["versions"][0] == 0 and r["versions"][-1] == 1 for r in responses)  # one spans the update
