"""MoE routing replay (``actor.routing_replay``, ``megarl.actor.moe_routing``) on a tiny Qwen3-MoE actor.

The reference is independent of megarl: the HF model, one sequence at a time, its gates sent to the given
experts (``tests/actor/replay_workers.py``). Layouts: EP2 (experts on two DP ranks), EP2 with TP2 and
sequence parallelism (each TP rank routes half of the tokens), PP2 (two MoE layers on each stage), EP2
with CP2 (each context-parallel rank routes its chunks of every sequence).
"""

from __future__ import annotations

import pytest
import torch

from megarl.actor.moe_routing import TokenRouterReplay, server_routes
from megarl.config import ConfigError
from megarl.config.ppo import PPOActorConfig
from tests.actor.dist_utils import run_ranks
from tests.actor.replay_workers import hf_logp_with_routes, merge_rows, random_routes, scaled_copy
from tests.actor.workers import make_grouped_batch

LAYERS, EXPERTS, TOP_K = 4, 4, 2  # the tiny qwen3_moe (megarl.models.tiny)
LOGP_TOL = 1e-4  # fp32 Megatron vs fp32 HF on one rank (tests/actor/test_parity.py); replay adds no arithmetic
LAYOUTS = [
    pytest.param("d1p1t1", 1, marks=pytest.mark.slow),
    # EP2 alone: d1p1t2e2et1 below has the same two expert ranks (and TP2 with sequence parallelism)
    pytest.param("d2p1t1e2", 2, marks=pytest.mark.slow),
    ("d1p1t2e2et1", 2),
    ("d1p2t1", 2),
    ("d1p1t1e2c2", 2),  # each context-parallel rank routes its chunks of every sequence
]


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir):
    return tiny_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def routed(moe_dir):
    """A grouped batch whose ``routed_experts`` are random top-2 sets (a prompt routes alike within its group),
    the HF model's logprobs sent along them, and its logprobs routing freely."""
    batch = make_grouped_batch(4, 2, prompt_len=6, seed=5)
    batch["rewards"] = torch.tensor([1.0, 0.0] * 4)  # every group has something to learn: no row skipped
    batch["routed_experts"] = random_routes(batch, LAYERS, EXPERTS, TOP_K, group=2)
    forced = hf_logp_with_routes(moe_dir, batch, batch["routed_experts"])
    free = hf_logp_with_routes(moe_dir, batch, None)
    return batch, forced, free


def _run(moe_dir, batch, alloc, world, mode, **overrides) -> list:
    target = "tests.actor.replay_workers:replay_step"
    return run_ranks(world, target, model_dir=str(moe_dir), alloc=alloc, batch=batch, mode=mode, **overrides)


def _scored(batch) -> torch.Tensor:
    """Positions whose next token is trained (next-token aligned loss mask)."""
    return torch.roll(batch["loss_mask"], -1, dims=1).bool() & batch["attention_mask"].bool()


# ---------------------------------------------------------------------------------------------- one router


def _top2(scores: torch.Tensor, k: int, num_groups=None, group_topk=None):
    return torch.topk(scores, k=k, dim=1)


def test_a_token_with_a_route_takes_it_and_one_without_routes_itself():
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay = TokenRouterReplay()
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.0, 5.0, 1.0, 2.0]])
    replay.target_topk_idx = torch.tensor([[2, 3], [-1, -1], [0, 2]])
    replay.tokens = torch.tensor([True, True, False])  # the last row is packing's padding
    probs, indices = replay.get_replay_topk(scores, 2, None, None, _top2)
    assert indices.tolist() == [[2, 3], [3, 2], [0, 2]]
    assert probs.tolist() == [[2.0, 1.0], [4.0, 3.0], [0.0, 1.0]], "the router's own scores at those experts"
    assert replay.counts.tolist() == [1.0, 1.0, 0.0], "one token replayed, one routed itself, padding not counted"
    replay.counts.zero_()
    replay.target_topk_idx = torch.tensor([[1, 0], [0, 1], [0, 2]])  # row 0: the router's own set, reordered
    replay.get_replay_topk(scores, 2, None, None, _top2)
    assert replay.counts.tolist() == [2.0, 0.0, 1.0], "row 0 agrees with its own top-2, row 1 does not"


def test_a_checkpointed_forward_queues_its_routes_for_the_recompute():
    """With activation recompute the backward re-runs a micro-batch's forward after later micro-batches set
    their own routes (pipeline schedules): the recompute takes the routes of its own first forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay = TokenRouterReplay()
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replay.checkpointed = True
    scores = torch.rand(1, 4)
    first, second = torch.tensor([[0, 1]]), torch.tensor([[2, 3]])
    with torch.no_grad():  # Megatron's checkpointed forward runs without autograd
        replay.target_topk_idx = first
        replay.get_replay_topk(scores, 2, None, None, _top2)
        replay.target_topk_idx = second
        replay.get_replay_topk(scores, 2, None, None, _top2)
    assert replay.get_replay_topk(scores, 2, None, None, _top2)[1].tolist() == [[0, 1]]  # recompute, in order
    assert replay.get_replay_topk(scores, 2, None, None, _top2)[1].tolist() == [[2, 3]]
    assert replay.counts.tolist()[:2] == [2.0, 0.0], "recomputes are not counted again"


def test_server_routes_are_position_aligned():
    """``routed_experts[i]`` is the forward at position ``i - 1``; the trainer replays position ``t`` with
    ``routed_experts[t + 1]``, and nothing at a row's last token or padding."""
    data = {
        "attention_mask": torch.tensor([[1, 1, 1, 0]]),
        "routed_experts": torch.tensor([[[-1], [5], [6], [0]]], dtype=torch.int16),
    }
    assert server_routes(data)[0, :, 0].tolist() == [5, 6, -1, -1]
    assert server_routes({"attention_mask": data["attention_mask"]}) is None


def test_r2_without_a_proximal_pass_and_unknown_modes_are_refused():
    with pytest.raises(ConfigError, match="routing_replay"):
        PPOActorConfig(path="unused", routing_replay="R2").check()  # one mini-batch, one epoch
    PPOActorConfig(path="unused", routing_replay="R2", ppo_n_minibatches=2).check()
    with pytest.raises(ConfigError, match="routing_replay"):
        PPOActorConfig(path="unused", routing_replay="R4").check()


# ---------------------------------------------------------------------------------------------- layouts


@pytest.mark.multiproc
@pytest.mark.parametrize("alloc, world", LAYOUTS)
def test_r3_routes_every_token_as_the_server_did(moe_dir, routed, alloc, world):
    """The proximal pass equals the HF model sent along the servers' routes (and not the freely routing
    one); the update's forward routes every route-carrying token as the server did (``topk_match`` 1)."""
    batch, forced, free = routed
    results = _run(moe_dir, batch, alloc, world, "R3")
    logp = merge_rows(results, "prox_logp", batch["input_ids"].shape).double()
    scored = _scored(batch)
    assert (logp - forced["logp"]).abs()[scored].max() <= LOGP_TOL
    assert (logp - free["logp"]).abs()[scored].max() > 100 * LOGP_TOL, "the servers' routes are not the model's own"
    first = results[0]["stats"][0]
    assert first["ppo_actor/gap/routing/topk_match"] == 1.0
    assert first["ppo_actor/routing_replay/own_match"] < 0.5, "the router alone agrees with random routes by chance"
    tokens = batch["attention_mask"].bool()
    expected = float(((server_routes(batch) >= 0).all(-1) & tokens).sum() / tokens.sum())
    shares = [s["ppo_actor/routing_replay/replayed_share"] for s in results[0]["stats"]]
    assert sum(shares) / 2 == pytest.approx(expected, abs=0.05), "each row's last token routes itself"


@pytest.mark.multiproc
def test_r3_under_truncation_replay_routes_as_the_server_did(moe_dir, routed):
    """The sampling's top-k / top-p replay (``megarl.kernels.truncation``) changes the head, not the routing."""
    batch, _, _ = routed
    results = _run(moe_dir, batch, "d2p1t1e2", 2, "R3", top_k=20, top_p=0.9)
    first = results[0]["stats"][0]
    assert first["ppo_actor/gap/routing/topk_match"] == 1.0
    assert first["ppo_actor/routing_replay/own_match"] < 0.5


@pytest.mark.multiproc
def test_without_replay_the_trainer_routes_itself(moe_dir, routed):
    batch, _, free = routed
    results = _run(moe_dir, batch, "d2p1t1e2", 2, "none")
    logp = merge_rows(results, "prox_logp", batch["input_ids"].shape).double()
    assert (logp - free["logp"]).abs()[_scored(batch)].max() <= LOGP_TOL
    first = results[0]["stats"][0]
    assert first["ppo_actor/gap/routing/topk_match"] < 0.5  # random top-2 of 4 sets: 1/6 agree by chance
    assert "ppo_actor/routing_replay/replayed_share" not in first


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "alloc, world", [pytest.param("d1p1t2", 2, marks=pytest.mark.slow), ("d1p2t1", 2), ("d1p1t1e2c2", 2)]
)
def test_r2_records_the_proximal_routing_and_replays_it(moe_dir, routed, alloc, world):
    """R2 records the trainer's own routing in the proximal pass (sequence-parallel halves gathered, each
    pipeline stage its own layers) and the update replays it for every token, each at its own position."""
    batch, _, free = routed
    results = _run(moe_dir, batch, alloc, world, "R2")
    recorded = torch.full((*batch["input_ids"].shape, LAYERS * TOP_K), -1, dtype=torch.int16)
    for r in results:  # stages hold their own layers, -1 elsewhere
        part = r["recorded"]
        recorded[..., : part.shape[-1]] = torch.maximum(recorded[..., : part.shape[-1]], part)
    own = torch.roll(free["routed"], -1, dims=1)  # the HF model's own routing, position-aligned
    positions = server_routes(batch)[..., 0] >= 0  # a row's tokens but its last (which produced nothing)
    as_sets = [x.view(*x.shape[:2], LAYERS, TOP_K).sort(-1).values for x in (recorded, own)]
    assert torch.equal(as_sets[0][positions], as_sets[1][positions])
    first, second = results[0]["stats"]
    assert first["ppo_actor/routing_replay/replayed_share"] == second["ppo_actor/routing_replay/replayed_share"] == 1
    # the first mini-batch, packed otherwise, runs on the recording's weights: every record is its own choice
    assert first["ppo_actor/routing_replay/own_match"] == 1.0


@pytest.mark.multiproc
@pytest.mark.slow  # about 40 s; the schedule it guards is exercised by the PP2 layout above without recompute
def test_r3_with_activation_recompute_trains_as_without(moe_dir, routed):
    """Full recompute re-runs a micro-batch's forward in its backward, after the pipeline schedule gave later
    micro-batches their routes: the same update as without recompute (each recompute takes its own routes)."""
    batch, _, _ = routed
    plain = _run(moe_dir, batch, "d1p2t1", 2, "R3")
    recomputed = _run(moe_dir, batch, "d1p2t1", 2, "R3", gradient_checkpointing=True)
    shape = batch["input_ids"].shape
    after = [merge_rows(r, "logp_after", shape) for r in (plain, recomputed)]
    before = merge_rows(plain, "prox_logp", shape)
    scored = _scored(batch)
    assert (after[0] - before).abs()[scored].max() > 100 * LOGP_TOL, "the update moved the weights"
    assert (after[0] - after[1]).abs()[scored].max() <= LOGP_TOL


# ---------------------------------------------------------------------------------------------- the gap


@pytest.mark.multiproc
@pytest.mark.slow  # about 70 s: three EP2 runs; replay's exactness is the R3 layout tests' (in `make test`)
def test_r3_brings_the_moe_gap_down_to_the_dense_noise(tiny_model_dir, tmp_path_factory):
    """A bf16 "server" (the HF model in bf16, its own routes) against the fp32 trainer: without replay the
    gap is the dtype's noise plus the tokens routed elsewhere; with R3 the noise only, as for a dense model.

    Routing is made to matter as in trained MoEs: experts' outputs x8 (the random init's are small beside
    the residual) and the router's logits x0.3 (closer scores, so bf16 flips some top-2 choices). The dense
    model gets the same x8 on its MLP. Measured (2-core AVX2 EPYC, fp32 trainer at EP2): mean |gap| 0.0052
    without replay (topk_match 0.986), 0.0023 with R3 (1.0), 0.0033 dense; R3 with the answers' routes only
    (the prompt's routed by the trainer) 0.0034.
    """
    tmp = tmp_path_factory.mktemp("replay_gap")
    moe = scaled_copy(tiny_model_dir("qwen3_moe"), tmp / "moe", {"down_proj.weight": 8.0, "mlp.gate.weight": 0.3})
    dense = scaled_copy(tiny_model_dir("qwen3"), tmp / "dense", {"down_proj.weight": 8.0})
    batch = make_grouped_batch(12, 2, prompt_len=12, seed=5)
    batch["rewards"] = torch.tensor([1.0, 0.0] * 12)
    server = hf_logp_with_routes(moe, batch, None, dtype=torch.bfloat16)
    batch["routed_experts"] = server["routed"]
    scored = _scored(batch)

    def gap(mode: str) -> float:
        results = _run(moe, batch, "d2p1t1e2", 2, mode)
        trainer = merge_rows(results, "prox_logp", batch["input_ids"].shape).double()
        return float((trainer - server["logp"]).abs()[scored].mean())

    dense_gap = float(
        (_dense_logp(dense, batch, torch.float32) - _dense_logp(dense, batch, torch.bfloat16)).abs()[scored].mean()
    )
    no_replay, replayed = gap("none"), gap("R3")
    assert replayed <= 1.25 * dense_gap, (no_replay, replayed, dense_gap)
    assert no_replay >= 1.5 * replayed, (no_replay, replayed, dense_gap)


def _dense_logp(model_dir, batch: dict, dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        for b, n in enumerate(batch["attention_mask"].sum(-1).tolist()):
            ids = batch["input_ids"][b : b + 1, :n].long()
            logits = model(ids).logits[0].double()
            out[b, : n - 1] = logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    return out
