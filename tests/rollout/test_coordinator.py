"""DistRolloutCoordinator: DP heads drive rollout; whole groups re-split over DP; TP/PP/CP peers get the same data."""

from __future__ import annotations

import pytest
import torch

from megarl.rollout.coordinator import balance_groups, split_groups
from tests.actor.dist_utils import run_ranks


def _batch(group_ids: list[int], group_size: int, lengths: list[int]) -> dict:
    rows = len(group_ids) * group_size
    width = max(lengths)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for g, length in enumerate(lengths):
        mask[g * group_size : (g + 1) * group_size, :length] = True
    ids = torch.tensor([gid for gid in group_ids for _ in range(group_size)])
    return {"attention_mask": mask, "input_ids": ids[:, None].expand(rows, width).clone(), "rewards": ids.float()}


def test_split_groups_keeps_rows_together():
    groups = split_groups(_batch([7, 8, 9], 2, [3, 5, 4]), 2)
    assert [g["rewards"].tolist() for g in groups] == [[7, 7], [8, 8], [9, 9]]
    with pytest.raises(ValueError, match="whole groups of 4"):
        split_groups(_batch([1, 2, 3], 2, [1, 1, 1]), 4)


@pytest.mark.parametrize("seed", range(5))
def test_balance_groups_equal_counts_and_balanced_tokens(seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 500, (24,), generator=gen).tolist()
    shares = balance_groups(tokens, 4)
    assert sorted(i for share in shares for i in share) == list(range(24))
    assert all(len(share) == 6 for share in shares)
    loads = [sum(tokens[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(tokens), loads
    assert balance_groups(tokens, 4) == shares  # every rank computes the same split
    with pytest.raises(ValueError, match="cannot be split evenly"):
        balance_groups(tokens[:5], 2)


class _StubRollout:
    """Stands in for a DP head's rollout engine: a fixed batch per head (this test is about distribution)."""

    def __init__(self, dp_rank: int, group_size: int):
        self.dp_rank, self.group_size = dp_rank, group_size

    def prepare_batch(self, dataloader, workflow, should_accept_fn=None, progress=None):
        base = 100 * (self.dp_rank + 1)
        # head 0's groups are long, head 1's short: balancing must mix them
        lengths = [30, 28, 26] if self.dp_rank == 0 else [4, 3, 2]
        return _batch([base, base + 1, base + 2], self.group_size, lengths)


def coordinator_rank(alloc: str, group_size: int) -> dict:
    from megarl.actor.parallel import init_parallel
    from megarl.config.allocation import AllocationMode
    from megarl.rollout.coordinator import DataParallelLayout, DistRolloutCoordinator

    parallel = init_parallel(AllocationMode.from_str(alloc).train)
    layout = DataParallelLayout.from_parallel(parallel)
    rollout = _StubRollout(layout.dp_rank, group_size) if layout.is_head else None
    batch = DistRolloutCoordinator(rollout, layout, group_size).prepare_batch(None, None)
    return {
        "dp_rank": layout.dp_rank,
        "is_head": layout.is_head,
        "rewards": batch["rewards"].tolist(),
        "tokens": int(batch["attention_mask"].sum()),
    }


@pytest.mark.multiproc
@pytest.mark.parametrize("alloc, world", [("megatron:d2t2", 4), ("megatron:d2p1t2c2", 8)])
def test_dp2_heads_rebalance_and_peers_share(alloc, world):
    """TP peers, and with ``c2`` context-parallel peers and their TP peers, get their head's rows."""
    out = run_ranks(world, "tests.rollout.test_coordinator:coordinator_rank", alloc=alloc, group_size=2)
    assert sum(r["is_head"] for r in out) == 2
    by_dp = {}
    for r in out:
        by_dp.setdefault(r["dp_rank"], []).append(r)
    for peers in by_dp.values():
        assert len(peers) == world // 2
        assert all(p["rewards"] == peers[0]["rewards"] for p in peers), "peers must train on the same rows"
    shares = [by_dp[d][0]["rewards"] for d in sorted(by_dp)]
    assert all(len(s) == 6 for s in shares)
    every = sorted(x for s in shares for x in s)
    assert every == sorted([g for g in (100, 101, 102, 200, 201, 202) for _ in range(2)])
    for share in shares:  # whole groups only
        assert all(share[i] == share[i + 1] for i in range(0, len(share), 2))
    tokens = [by_dp[d][0]["tokens"] for d in sorted(by_dp)]
    assert max(tokens) - min(tokens) <= 2 * 30, f"unbalanced split {tokens} (head 0 alone has 168 tokens)"


class _InterruptedRollout(_StubRollout):
    """Head 0 stops gathering once (its servers wait for the trainer's weights), then delivers; head 1 at once."""

    def __init__(self, dp_rank: int, group_size: int):
        super().__init__(dp_rank, group_size)
        self.calls = 0

    def readmit_due(self) -> bool:
        return self.dp_rank == 0 and self.calls == 1

    def prepare_batch(self, dataloader, workflow, should_accept_fn=None, progress=None, interrupt=None):
        self.calls += 1
        if interrupt is not None and interrupt():
            return None
        return super().prepare_batch(dataloader, workflow, should_accept_fn, progress)


def readmitting_rank(alloc: str, group_size: int) -> dict:
    from megarl.actor.parallel import init_parallel
    from megarl.config.allocation import AllocationMode
    from megarl.rollout.coordinator import DataParallelLayout, DistRolloutCoordinator

    parallel = init_parallel(AllocationMode.from_str(alloc).train)
    layout = DataParallelLayout.from_parallel(parallel)
    rollout = _InterruptedRollout(layout.dp_rank, group_size) if layout.is_head else None
    readmits = []
    batch = DistRolloutCoordinator(rollout, layout, group_size).prepare_batch(
        None, None, readmit=lambda: readmits.append(1)
    )
    return {
        "dp_rank": layout.dp_rank,
        "rewards": batch["rewards"].tolist(),
        "readmits": len(readmits),
        "calls": rollout.calls if rollout is not None else 0,
    }


@pytest.mark.multiproc
def test_a_head_waiting_for_restarted_servers_has_every_rank_readmit_them():
    """Head 0 stops gathering (no server left until restarted ones get the weights): all four ranks push
    (``readmit``) once, head 1 keeps the batch it had, head 0 gathers again; the batch is as without it."""
    out = run_ranks(4, "tests.rollout.test_coordinator:readmitting_rank", alloc="megatron:d2t2", group_size=2)
    assert [r["readmits"] for r in out] == [1, 1, 1, 1]
    assert sorted(r["calls"] for r in out) == [0, 0, 1, 2], "head 1 must keep its batch, head 0 gather again"
    every = sorted(x for r in out if r["calls"] for x in r["rewards"])
    assert every == sorted([g for g in (100, 101, 102, 200, 201, 202) for _ in range(2)])
