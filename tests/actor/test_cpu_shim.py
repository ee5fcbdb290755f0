"""megarl.actor.cpu_shim: Megatron's gradient reduce-scatter and parameter all-gather over a one-rank
group skip gloo (which copies a buffer onto itself), and go through it over more ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megarl.actor import cpu_shim
from tests.actor.dist_utils import run_ranks


def _recording():
    calls = []

    def collective(output, input, group=None, async_op=False):
        calls.append((output.data_ptr(), input.data_ptr()))
        return "work" if async_op else None

    return cpu_shim._one_rank_shortcut(collective), calls


def shortcut_on_ranks() -> dict:
    dist.init_process_group("gloo")
    call, calls = _recording()
    buffer = torch.arange(8.0)
    shard = buffer.view(dist.get_world_size(), -1)[dist.get_rank()]
    out = {"async": call(buffer, shard, group=dist.group.WORLD, async_op=True)}
    target = torch.zeros(8)
    call(target, buffer, group=dist.group.WORLD)  # another buffer: its contents land in it
    out.update(calls=len(calls), target=target)
    if out["async"] is not None and not isinstance(out["async"], str):
        out["async"].wait()  # the stand-in handle of a skipped collective waits for nothing
        out["async"] = "handle"
    return out


def test_one_rank_collectives_are_skipped_and_more_ranks_go_through_gloo():
    one, two = run_ranks(1, f"{__name__}:shortcut_on_ranks")[0], run_ranks(2, f"{__name__}:shortcut_on_ranks")
    assert one["calls"] == 0 and one["async"] == "handle"  # the shard is the buffer: nothing to do
    assert torch.equal(one["target"], torch.arange(8.0))  # distinct memory: a copy, still no collective
    assert all(rank["calls"] == 2 and rank["async"] == "work" for rank in two)


@pytest.mark.skipif(cpu_shim.cuda_available(), reason="the shim is a no-op with CUDA")
def test_install_wraps_megatrons_buffer_collectives():
    from megatron.core.distributed import param_and_grad_buffer as buffers

    cpu_shim.install()
    for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        assert getattr(buffers, name).__wrapped__ in (
            torch.distributed.all_gather_into_tensor,
            torch.distributed.reduce_scatter_tensor,
            torch.distributed._all_gather_base,
            torch.distributed._reduce_scatter_base,
        ), name
