"""The train phase's throughput per step: tokens/s per rank, model TFLOP/s, and MFU on a GPU.

Megatron-LM and NeMo-RL print these every step; megarl records them in the step's stats (``perf/``):

* ``perf/train_tokens_per_s``: tokens trained per second by one rank (each of a DP head's
  ``tp x pp x cp`` ranks shares its tokens), every PPO epoch counted;
* ``perf/train_tflops``: model TFLOP/s per rank (:mod:`megarl.models.flops`, causal attention);
* on a GPU whose bf16 peak is known: ``perf/mfu`` and ``perf/mfu_megatron`` (attention counted
  with its full score matrix, as Megatron-LM's logs count it).

The phase's time is the actor's ``ppo_update`` (forward, backward, optimizer); a recomputed
proximal logprob pass (``recompute_logp``) is a phase of its own and not counted.
"""

from __future__ import annotations

import torch

from megarl.models.flops import MatmulShape, peak_bf16_flops, train_flops
from megarl.utils import stats_tracker


def record_train_throughput(actor, batch: dict, seconds: float, epochs: int, device: str) -> dict[str, float]:
    """Record (and return) the ``perf/`` stats of a train phase of ``seconds`` over ``batch``
    (``epochs`` passes) by ``actor`` (a Megatron engine: its model's HF config and parallel layout)."""
    if seconds <= 0:
        return {}
    seq_lens = batch["attention_mask"].sum(-1).tolist()
    alloc = actor.parallel.alloc
    ranks = alloc.tp * alloc.pp * alloc.cp
    shape = MatmulShape.from_hf_config(actor.desc.hf_config)
    per_rank_s = seconds * ranks / epochs
    flops_per_s = train_flops(shape, seq_lens) / per_rank_s
    stats = {"train_tokens_per_s": sum(seq_lens) / per_rank_s, "train_tflops": flops_per_s / 1e12}
    peak = peak_bf16_flops(torch.cuda.get_device_name()) if device == "cuda" else None
    if peak is not None:
        stats["mfu"] = flops_per_s / peak
        stats["mfu_megatron"] = train_flops(shape, seq_lens, "megatron") / per_rank_s / peak
    with stats_tracker.scope("perf"):
        stats_tracker.scalar(**stats)
    return stats


def record_train_parts(clock: dict[str, float], seconds: float) -> dict[str, float]:
    """Record (and return) where a train phase of ``seconds`` went, from the actor's
    :attr:`~megarl.actor.engine.MegatronEngine.train_clock` (on a CPU; empty on a GPU): under
    ``timeperf/train_step/``, ``forward`` (the model, the logprob head and the loss), ``backward``
    (Megatron's pass less the forward: backward and the gradients' reduction), ``optimizer`` (the
    step: gradients to the main weights, norm and clipping, Adam) and ``other`` (the rest: micro-batch
    packing, the loss's bookkeeping, the stats)."""
    if not clock:
        return {}
    forward, schedule, optimizer = (clock.get(k, 0.0) for k in ("forward", "schedule", "optimizer"))
    parts = {
        "forward": forward,
        "backward": max(0.0, schedule - forward),
        "optimizer": optimizer,
        "other": max(0.0, seconds - schedule - optimizer),
    }
    stats_tracker.scalar(**{f"timeperf/train_step/{name}": value for name, value in parts.items()})
    return parts
