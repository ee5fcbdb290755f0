"""Megatron's overlapped gradient reduce-scatter and parameter all-gather of the distributed optimizer
(``actor.megatron.overlap_grad_reduce``, ``overlap_param_gather``, on in the 7B presets): the same steps
as without them, bit for bit, on CPU (gloo)."""

from __future__ import annotations

import pytest
import torch

from megarl.config.allocation import AllocationMode
from tests.actor.dist_utils import run_ranks

pytestmark = pytest.mark.multiproc


def overlap_steps(model_dir: str, alloc: str, batches: list, overlap: bool) -> dict:
    """Three PPO steps with the distributed optimizer, then the logprobs of the first batch."""
    from megarl.actor.engine import MegatronEngine
    from megarl.config.train import OptimizerConfig
    from megarl.models.hf_io import gather_hf_tensors
    from tests.actor.workers import _step, engine_config, split_rows

    optimizer = OptimizerConfig(lr=1e-3, weight_decay=0.01, gradient_clipping=1.0, use_distributed_optimizer=True)
    config = engine_config(
        model_dir, optimizer=optimizer, n_mbs=2, overlap_grad_reduce=overlap, overlap_param_gather=overlap
    )
    engine = MegatronEngine(config)
    engine.create_process_group(alloc)
    engine.initialize(ft_spec=10)
    ddp = engine.model[0].ddp_config
    assert (ddp.overlap_grad_reduce, ddp.overlap_param_gather) == (overlap, overlap), ddp
    losses = [_step(engine, b) for b in batches]
    p = engine.parallel
    weights = gather_hf_tensors(engine.model, engine.desc, engine.coords, p.tp_group, p.etp_group)
    return {
        "losses": losses,
        "weights": weights,  # as the weight sync, a checkpoint or the HF export read them, before any forward
        "logp": engine.eval().forward(split_rows(batches[0], p.dp_rank, p.alloc.dp)),
    }


@pytest.mark.parametrize("alloc", ["d2p1t1", "d2p2t1", "d2p1t2"])
def test_overlapped_reduce_and_gather_change_nothing(tiny_model_dir, alloc):
    from tests.actor.workers import make_batch

    model = str(tiny_model_dir("llama"))
    batches = [make_batch([7, 12, 5, 9], seed=s) for s in range(3)]
    ranks = AllocationMode.from_str(f"megatron:{alloc}").train.world_size
    plain, overlapped = (
        run_ranks(
            ranks, "tests.actor.test_overlap:overlap_steps", model_dir=model, alloc=alloc, batches=batches, overlap=o
        )
        for o in (False, True)
    )
    for a, b in zip(plain, overlapped):
        assert a["losses"] == b["losses"]
        assert torch.equal(a["logp"], b["logp"])
        assert a["weights"].keys() == b["weights"].keys()
        stale = [name for name, w in a["weights"].items() if not torch.equal(w, b["weights"][name])]
        assert not stale, f"weights read after a step are not the step's: {stale[:5]}"
