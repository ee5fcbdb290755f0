"""The Megatron settings the GPU presets turn on, each run on CPU (gloo) against the same steps without it:
the distributed optimizer's overlapped gradient reduce-scatter and parameter all-gather
(``actor.megatron.overlap_grad_reduce``, ``overlap_param_gather``: the dense 7B presets) and selective
activation recompute (``recompute_granularity: selective``: the 8-GPU 7B and the MoE presets, the latter
with experts over expert parallelism), alone and together as the presets combine them, in fp32 and in bf16
(the presets' dtype on a GPU, where the optimizer's fp32 main weights are copied into the bf16 ones before the
deferred all-gather). Each must give the same losses, logprobs and weights, bit for bit; the weights as the
weight sync, a checkpoint or the HF export read them right after the step. Selective recompute must also
take effect: each attention runs again in the backward."""

from __future__ import annotations

import pytest
import torch

from megarl.config.allocation import AllocationMode
from tests.actor.dist_utils import run_ranks

pytestmark = pytest.mark.multiproc

OVERLAP = {"overlap_grad_reduce": True, "overlap_param_gather": True}
SELECTIVE = {"recompute_granularity": "selective"}


def flagged_steps(model_dir: str, alloc: str, batches: list, megatron: dict, dtype: str) -> dict:
    """Three PPO steps with the distributed optimizer and the ``megatron`` settings, then the weights and the
    logprobs of the first batch, and how many times the steps ran an attention."""
    from megarl.actor.engine import MegatronEngine
    from megarl.config.train import OptimizerConfig
    from megarl.models.hf_io import gather_hf_tensors
    from megarl.models.layers import SDPACoreAttention
    from tests.actor.workers import _step, engine_config, split_rows

    optimizer = OptimizerConfig(lr=1e-3, weight_decay=0.01, gradient_clipping=1.0, use_distributed_optimizer=True)
    engine = MegatronEngine(engine_config(model_dir, dtype=dtype, optimizer=optimizer, n_mbs=2, **megatron))
    engine.create_process_group(alloc)
    engine.initialize(ft_spec=10)
    ddp, block = engine.model[0].ddp_config, engine.tconfig
    for key, value in megatron.items():  # the settings reached Megatron
        assert getattr(ddp, key, None) == value or getattr(block, key, None) == value, key
    attention_runs, forward = [0], SDPACoreAttention.forward

    def counted(self, *args, **kwargs):
        attention_runs[0] += 1
        return forward(self, *args, **kwargs)

    SDPACoreAttention.forward = counted
    losses = [_step(engine, b) for b in batches]
    SDPACoreAttention.forward = forward
    p = engine.parallel
    weights = gather_hf_tensors(engine.model, engine.desc, engine.coords, p.tp_group, p.etp_group)
    return {
        "losses": losses,
        "weights": weights,  # before any forward: as the weight sync, a checkpoint or the HF export read them
        "logp": engine.eval().forward(split_rows(batches[0], p.dp_rank, p.alloc.dp)),
        "attention_runs": attention_runs[0],
    }


@pytest.mark.parametrize(
    "family,alloc,megatron,dtype",
    [
        ("llama", "d2p1t1", OVERLAP, "float32"),
        ("llama", "d2p2t1", OVERLAP, "float32"),
        ("llama", "d2p1t2", OVERLAP, "float32"),
        ("llama", "d2p1t1", OVERLAP, "bfloat16"),
        ("llama", "d2p1t2", OVERLAP, "bfloat16"),
        ("llama", "d2p1t1", SELECTIVE, "float32"),
        ("llama", "d1p1t2", SELECTIVE, "float32"),
        ("llama", "d2p2t1", OVERLAP | SELECTIVE, "bfloat16"),  # the 8-GPU 7B preset's settings and layout
        ("llama", "d2p2t2", OVERLAP, "bfloat16"),  # the 32-GPU preset's shape (eight ranks)
        ("qwen3_moe", "d1p1t2e2et1", SELECTIVE, "float32"),  # as the MoE presets: experts over EP, attention over TP
        ("qwen3_moe", "d1p2t2e2et1", SELECTIVE, "float32"),  # ... and two pipeline stages
    ],
    ids=lambda v: v if isinstance(v, str) else "+".join(v),
)
def test_a_presets_setting_changes_nothing(tiny_model_dir, family, alloc, megatron, dtype):
    from tests.actor.workers import make_batch

    model = str(tiny_model_dir(family))
    batches = [make_batch([7, 12, 5, 9], seed=s) for s in range(3)]
    ranks = AllocationMode.from_str(f"megatron:{alloc}").train.world_size
    target = "tests.actor.test_megatron_flags:flagged_steps"
    plain, flagged = (
        run_ranks(ranks, target, model_dir=model, alloc=alloc, batches=batches, megatron=m, dtype=dtype)
        for m in ({}, megatron)
    )
    for a, b in zip(plain, flagged):
        assert a["losses"] == b["losses"]
        assert torch.equal(a["logp"], b["logp"])
        assert a["weights"].keys() == b["weights"].keys()
        stale = [name for name, w in a["weights"].items() if not torch.equal(w, b["weights"][name])]
        assert not stale, f"weights read after a step are not the step's: {stale[:5]}"
        recomputed = 2 if "recompute_granularity" in megatron else 1  # forward, and again in the backward
        assert b["attention_runs"] == recomputed * a["attention_runs"] > 0


def ppo_actor_steps(model_dir: str, alloc: str, batch: dict, megatron: dict) -> dict:
    """``ppo_update`` of MegatronPPOActor (two mini-batches, zero-advantage rows left out) with the distributed
    optimizer and the ``megatron`` settings, on this rank's groups: its stats and the weights after."""
    from megarl.config.train import MegatronConfig, OptimizerConfig
    from megarl.models.hf_io import gather_hf_tensors
    from tests.actor.workers import _ppo_actor, split_groups

    optimizer = OptimizerConfig(lr=1e-3, weight_decay=0.01, gradient_clipping=1.0, use_distributed_optimizer=True)
    settings = {"megatron": MegatronConfig(**megatron)}
    actor = _ppo_actor(model_dir, alloc, settings, ppo_n_minibatches=2, optimizer=optimizer)
    p = actor.parallel
    data = split_groups(batch, p.dp_rank, p.alloc.dp, actor.config.group_size)
    data["prox_logp"] = actor.compute_logp(data)
    actor.compute_advantages(data)
    stats = actor.ppo_update(data)
    weights = gather_hf_tensors(actor.model, actor.desc, actor.coords, p.tp_group, p.etp_group)
    return {"stats": stats, "weights": weights}


IDLE_STEPS = {
    # groups of 2; rank 0 takes groups 0, 2, 4, 6 and rank 1 groups 1, 3, 5, 7; its mini-batches: the first two,
    # then the last two. A group whose two samples got one reward has advantage 0 (nothing to learn).
    "nothing-anywhere": ([1, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 0, 0], [0.0, 2.0], [4.0, 2.0]),
    "nothing-on-one-rank": ([1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 0, 1, 0, 0], [2.0, 2.0], [0.0, 2.0]),
}


@pytest.mark.parametrize("case", list(IDLE_STEPS))
def test_the_ppo_actors_update_is_the_same_under_the_overlap(tiny_model_dir, case):
    """The PPO actor's update under the 7B presets' overlap at DP2, two mini-batches. With nothing to learn on
    any rank only the optimizer steps (no pass runs: the weights must still be gathered, where Megatron
    thought them gathered since the last forward); with nothing on one rank it runs a placeholder row that
    scores nothing (whose zero gradient must still reach the LM head: the overlapped reduction waits for it)."""
    from tests.actor.test_skip_zero_advantage import grouped_batch

    rewards, n_mbs, skipped = IDLE_STEPS[case]
    batch = grouped_batch([float(r) for r in rewards])
    model, target = str(tiny_model_dir("llama")), "tests.actor.test_megatron_flags:ppo_actor_steps"
    plain, flagged = (
        run_ranks(2, target, model_dir=model, alloc="d2p1t1", batch=batch, megatron=m) for m in ({}, OVERLAP)
    )
    steps = plain[0]["stats"]  # averaged over the data-parallel ranks
    assert [step["ppo_actor/n_mbs"] for step in steps] == n_mbs  # 0: no pass on any rank
    assert [step["ppo_actor/skipped_seqs"] for step in steps] == skipped  # 2.0: 4 rows on rank 1, none on rank 0
    for a, b in zip(plain, flagged):
        assert a["stats"] == b["stats"]
        stale = [name for name, w in a["weights"].items() if not torch.equal(w, b["weights"][name])]
        assert not stale, f"weights after the update differ under the overlap: {stale[:5]}"
