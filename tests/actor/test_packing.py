"""Sequence packing: token-budget grouping, packed layout, labels within sequences, unpacking."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.actor.packing import pack, split_by_token_budget, unpack


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
