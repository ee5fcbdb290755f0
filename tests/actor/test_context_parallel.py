"""The context-parallel layout of a packed micro-batch (``megarl.actor.context_parallel``), on one process.

Whole-model checks at ``c2`` (logprobs, loss, gradients against one rank and HF) are in
``tests/actor/test_parity.py``; these pin the layout itself: Megatron's load-balanced chunks, the
padding, and that every token of the stream is held by exactly one rank.
"""

from __future__ import annotations

import random

import pytest
import torch

from megarl.actor.context_parallel import padded_length, split_for_context
from megarl.models.layers import context_chunks, context_positions


def test_a_rank_holds_chunks_r_and_2c_minus_1_minus_r():
    assert context_chunks(8, 2, 0) == (range(0, 2), range(6, 8))
    assert context_chunks(8, 2, 1) == (range(2, 4), range(4, 6))
    assert context_chunks(12, 3, 1) == (range(2, 4), range(8, 10))
    with pytest.raises(ValueError, match="does not split into 2 x 2"):
        context_chunks(6, 2, 0)


def test_sequences_are_padded_at_their_end_and_split_between_ranks():
    # a stream of 5 + 3 tokens and 1 token of packing's own padding, over 2 ranks in 16 padded tokens:
    # the sequences pad to 8 and 4, a padding segment of 4 fills the rest
    ranks = [split_for_context([5, 3], stream_len=9, padded_len=16, size=2, rank=r, group=None) for r in (0, 1)]
    assert ranks[0].cu_seqlens.tolist() == [0, 8, 12, 16] and ranks[0].max_seqlen == 8
    assert ranks[0].local_index.tolist() == [0, 1, -1, -1, 5, -1, -1, -1]
    assert ranks[1].local_index.tolist() == [2, 3, 4, -1, 6, 7, -1, -1]
    assert ranks[0].gathered_index.tolist() == ranks[0].local_index.tolist() + ranks[1].local_index.tolist()
    stream = torch.arange(9) * 10
    assert ranks[1].local(stream).tolist() == [20, 30, 40, 0, 60, 70, 0, 0]  # padding reads 0


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_token_is_held_once_and_every_rank_holds_as_many(cp):
    rng = random.Random(cp)
    lengths = [rng.randint(1, 40) for _ in range(7)]
    stream_len = sum(lengths) + 3
    padded_len = padded_length(lengths, cp) + 2 * cp
    ranks = [split_for_context(lengths, stream_len, padded_len, cp, r, None) for r in range(cp)]
    held = torch.cat([r.local_index for r in ranks])
    assert sorted(held[held >= 0].tolist()) == list(range(sum(lengths)))  # packing's trailing padding: nobody's
    assert {len(r.local_index) for r in ranks} == {padded_len // cp}
    cu = ranks[0].cu_seqlens.tolist()
    assert all((b - a) % (2 * cp) == 0 for a, b in zip(cu, cu[1:]))
    # the causal attention's work (keys a query sees: its position + 1) is the same on every rank
    work = {sum(p - a + 1 for a, b in zip(cu, cu[1:]) for p in context_positions([a, b], cp, r)) for r in range(cp)}
    assert len(work) == 1
