"""Sequence packing: token-budget grouping, packed layout, labels within sequences, unpacking."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.actor.packing import Unit, pack, pack_units, sequence_lengths, split_by_token_budget, unpack


def _batch(lengths):
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1) + 100 * i
        mask[i, :n] = True
    return {"input_ids": ids, "attention_mask": mask, "rewards": torch.arange(len(lengths)).float()}


@given(st.lists(st.integers(1, 50), min_size=1, max_size=20), st.integers(1, 120), st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_groups_cover_every_sequence_once_and_respect_the_budget(lengths, budget, min_groups):
    groups = split_by_token_budget(lengths, budget, min_groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) >= min(min_groups, len(lengths))
    for g in groups:
        assert sum(lengths[i] for i in g) <= budget or len(g) == 1


def test_pack_concatenates_rows_with_boundaries_labels_and_padding():
    batch = _batch([3, 2, 4])
    (mb,) = pack(batch, [[0, 2]], padded_len=8)
    assert mb.data["input_ids"].tolist() == [1, 2, 3, 201, 202, 203, 204, 0]
    assert mb.cu_seqlens.tolist() == [0, 3, 7, 8]  # trailing padding is its own segment
    assert mb.data["labels"].tolist() == [2, 3, 0, 202, 203, 204, 0, 0]
    assert mb.data["label_mask"].tolist() == [True, True, False, True, True, True, False, False]
    assert mb.data["rewards"].tolist() == [0.0, 2.0]


def test_unpack_restores_the_padded_layout():
    batch = _batch([3, 2, 4])
    mbs = pack(batch, [[1], [0, 2]], padded_len=7)
    back = unpack([mb.data["input_ids"] for mb in mbs], mbs, 3, 4)
    assert torch.equal(back, batch["input_ids"])


def _grouped(prompts: list[int], answers: list[list[int]], shift_mask: bool) -> dict:
    """Rows ``prompt ids + answer ids``; row i's prompt is ``prompts[i]`` tokens of group ``i // len``."""
    rows = [list(range(1000 * p, 1000 * p + n)) + a for (p, n), a in zip(prompts, answers)]
    width = max(len(r) for r in rows)
    batch = _batch([len(r) for r in rows])
    batch["input_ids"] = torch.zeros(len(rows), width, dtype=torch.int64)
    batch["loss_mask"] = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, (row, (_, n)) in enumerate(zip(rows, prompts)):
        batch["input_ids"][i, : len(row)] = torch.tensor(row)
        batch["loss_mask"][i, n - int(shift_mask) : len(row) - int(shift_mask)] = 1
    return batch


def test_a_group_shares_its_prompt_up_to_two_tokens_before_the_first_scored_one():
    # rows 0-2 answer prompt 1 (5 tokens), rows 0-1 also agree on their first answer token; row 3 is alone
    prompts = [(1, 5), (1, 5), (1, 5), (2, 4)]
    answers = [[7, 8], [7, 9, 9], [6], [5, 5]]
    for shifted, shared in ((False, 4), (True, 3)):  # the rollout's alignment, then compute_advantages'
        batch = _grouped(prompts, answers, shifted)
        units = pack_units(batch, max_tokens=100, share_prefix=True)
        assert units == [Unit((0, 1, 2), shared), Unit((3,))]
        (mb,) = pack(batch, [units], padded_len=24)
        assert mb.num_tokens == shared + (7 - shared) + (8 - shared) + (6 - shared) + 6
        prefix, *branches = mb.segments[:4]
        assert (prefix.rows, prefix.start, prefix.end) == ((0, 1, 2), 0, shared)
        assert [b.parent for b in branches] == [0, 0, 0] and mb.parents[4:] == (None, None)
        assert not (mb.data["loss_mask"][:shared] | torch.roll(mb.data["loss_mask"], -1)[:shared]).any()
    assert pack_units(batch, max_tokens=100, share_prefix=False) == [Unit((r,)) for r in range(4)]


def test_a_group_over_the_token_budget_is_cut_into_units_that_each_share():
    batch = _grouped([(1, 6)] * 5, [[1, 2, 3]] * 5, shift_mask=False)  # 5 rows of 9 tokens, 5 shareable
    units = pack_units(batch, max_tokens=5 + 4 * 2, share_prefix=True)
    assert units == [Unit((0, 1), 5), Unit((2, 3), 5), Unit((4,))]
    assert [u.num_tokens(sequence_lengths(batch)) for u in units] == [13, 13, 9]


@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=4),  # group sizes
    st.integers(1, 6),  # prompt length
    st.data(),
)
@settings(max_examples=100, deadline=None)
def test_shared_packing_gives_every_row_its_own_labels_and_positions(sizes, prompt_len, data):
    prompts = [(g, prompt_len) for g, size in enumerate(sizes) for _ in range(size)]
    answers = [data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=4)) for _ in prompts]
    batch = _grouped(prompts, answers, shift_mask=data.draw(st.booleans()))
    n, width = batch["input_ids"].shape
    plain = pack(batch, [list(range(n))], padded_len=batch["attention_mask"].sum().item())
    units = pack_units(batch, max_tokens=data.draw(st.integers(1, 20)), share_prefix=True)
    groups = split_by_token_budget([u.num_tokens(sequence_lengths(batch)) for u in units], 20)
    shared = pack(batch, [[units[i] for i in g] for g in groups], padded_len=max(20, width))
    for key in ("input_ids", "labels", "label_mask", "position_ids", "loss_mask"):
        want = unpack([plain[0].data[key]], plain, n, width)
        assert torch.equal(unpack([mb.data[key] for mb in shared], shared, n, width), want), key
    assert sum(mb.num_tokens for mb in shared) <= batch["attention_mask"].sum()
