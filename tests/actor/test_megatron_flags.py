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
        ("qwen3_moe", "d1p1t2e2et1", SELECTIVE, "float32"),  # as the MoE presets: experts over EP, attention over TP
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
