"""The engine's batches through Megatron: packed micro-batches of a token budget, the pipeline schedule.

:func:`plan_microbatches` packs a batch into micro-batches whose count and length agree across the
data-parallel ranks (and fill whole virtual-pipeline groups); :func:`run_schedule` runs them through
Megatron's forward-backward function (1F1B; interleaved with VPP), telling the engine's micro-batch hooks
each one around a chunk's forward and timing the forward on the engine's clock.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial

import torch
import torch.distributed as dist

from megarl.actor import cpu_shim
from megarl.actor.context_parallel import padded_length, split_for_context
from megarl.actor.packing import (
    MicroBatch,
    MicroBatchHook,
    pack,
    pack_units,
    round_up,
    sequence_lengths,
    split_by_token_budget,
)
from megarl.actor.parallel import ParallelState
from megarl.config.train import MicroBatchSpec
from megarl.models.layers import SharedPrefixSeqParams
from megarl.utils import heartbeat
from megarl.utils.part_clock import PartClock


def plan_microbatches(
    batch: dict, spec: MicroBatchSpec, parallel: ParallelState, share_prefix: bool
) -> list[MicroBatch]:
    """Pack ``batch`` by ``spec``'s token budget; count and length agree across DP ranks (and fit VPP)."""
    alloc = parallel.alloc
    units = pack_units(batch, spec.max_tokens_per_mb, share_prefix)
    seqlens = sequence_lengths(batch)
    sizes = [unit.num_tokens(seqlens) for unit in units]
    n_groups = len(split_by_token_budget(sizes, spec.max_tokens_per_mb, spec.n_mbs))
    if alloc.vpp > 1:  # interleaved schedule: micro-batches in whole groups of PP
        n_groups = round_up(max(n_groups, alloc.pp), alloc.pp)
    (n_groups,) = all_reduce_max([n_groups], parallel)
    groups = split_by_token_budget(sizes, spec.max_tokens_per_mb, n_groups)
    groups += [[] for _ in range(n_groups - len(groups))]
    longest = max(sum(sizes[i] for i in g) for g in groups)
    (longest,) = all_reduce_max([longest], parallel)
    mbs = pack(batch, [[units[i] for i in g] for g in groups], round_up(max(longest, 1), alloc.tp))
    return split_over_context(mbs, parallel) if alloc.cp > 1 else mbs


def split_over_context(mbs: list[MicroBatch], parallel: ParallelState) -> list[MicroBatch]:
    """``mbs`` with their context-parallel layout (``megarl.actor.context_parallel``): one padded length
    for every micro-batch and data-parallel rank, whose share of each context-parallel rank splits
    evenly over the tensor-parallel ranks (sequence parallelism)."""
    cp = parallel.alloc.cp
    lengths = [[s.length for s in mb.segments if s.rows] for mb in mbs]  # the trailing padding is not one
    (longest,) = all_reduce_max([max(padded_length(n, cp) for n in lengths)], parallel)
    padded_len = round_up(max(longest, 1), 2 * cp * parallel.alloc.tp)
    split = partial(split_for_context, padded_len=padded_len, size=cp, rank=parallel.cp_rank, group=parallel.cp_group)
    return [dataclasses.replace(mb, context=split(n, mb.padded_len)) for n, mb in zip(lengths, mbs)]


def all_reduce_max(values: list[int], parallel: ParallelState) -> list[int]:
    """The largest of each of ``values`` over the data-parallel (and context-parallel) ranks."""
    tensor = torch.tensor(values, dtype=torch.int64, device=cpu_shim.device())
    if parallel.alloc.dp * parallel.alloc.cp > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=parallel.dp_group)
    return tensor.tolist()


def packed_seq_params(mb: MicroBatch):
    """Megatron's ``PackedSeqParams`` of ``mb`` (THD layout; with shared prefixes, their parents too; with
    context parallelism, of the padded stream, whose padding is each segment's last tokens)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    split = mb.context
    cu, longest = (mb.cu_seqlens, mb.max_seqlen) if split is None else (split.cu_seqlens, split.max_seqlen)
    cu = cu.to(cpu_shim.device())
    thd = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest)
    if split is not None:  # TransformerEngine reads the padded bounds (here the same)
        return PackedSeqParams(**thd, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
    if mb.shares_prefixes:
        return SharedPrefixSeqParams(**thd, parents=mb.parents)
    return PackedSeqParams(**thd)


def run_schedule(
    chunks: list,
    mbs: list[MicroBatch],
    extras: list,
    head_fn,
    forward_only: bool,
    hooks: list[MicroBatchHook],
    clock: PartClock,
) -> list:
    """Run ``mbs`` (each with its ``extras`` item) through the model ``chunks``; ``head_fn(model, mb, extra,
    output)`` is each micro-batch's loss (or, ``forward_only``, what it returns). Megatron's outputs."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    items = list(zip(mbs, extras))
    return get_forward_backward_func()(
        forward_step_func=_forward_step(head_fn, len(mbs) * len(chunks), forward_only, hooks, clock),
        data_iterator=[iter(items) for _ in chunks],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(mbs),
        seq_length=mbs[0].context.padded_len if mbs[0].context is not None else mbs[0].padded_len,
        micro_batch_size=1,
        forward_only=forward_only,
    )


def _forward_step(head_fn, total: int, forward_only: bool, hooks: list[MicroBatchHook], clock: PartClock):
    """Megatron ``forward_step_func``: run a chunk on the next micro-batch; ``head_fn`` is its loss."""
    device = cpu_shim.device()
    calls = itertools.count(1)  # one per micro-batch and model chunk (virtual pipeline stage)
    what = "forward" if forward_only else "forward-backward"

    def forward_step(data_iterator, model):
        heartbeat.step(f"micro-batch {what} {next(calls)} of {total}")  # the watchdog names where a rank is
        mb, extra = next(data_iterator)
        # packing happens on the host; losses and hooks see the micro-batch on the model's device
        context = mb.context.to(device) if mb.context is not None else None
        mb = dataclasses.replace(mb, data={k: _to(v, device) for k, v in mb.data.items()}, context=context)
        for hook in hooks:
            hook.before_forward(model, mb)
        ids = mb.data["input_ids"]
        ids = (ids if mb.context is None else mb.context.local(ids))[None]
        # RoPE at each token's column in its row: only a shared prefix's branches need it
        positions = mb.data["position_ids"][None] if mb.shares_prefixes else None
        output = clock.timed("forward", model)(  # the model's forward, then the head's (below)
            input_ids=ids, position_ids=positions, attention_mask=None, packed_seq_params=packed_seq_params(mb)
        )
        for hook in hooks:
            hook.after_forward(model, mb)
        return output, partial(clock.timed("forward", head_fn), model, mb, extra)

    return forward_step


def _to(value, device):
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
