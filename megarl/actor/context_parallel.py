"""Context parallelism: every sequence of a packed micro-batch split over the context-parallel ranks.

With ``c`` > 1 in the training allocation (``megatron:d2p1t2c2``) the ``c`` ranks of a context-parallel
group train on the same rows, each on a part of every sequence, so a sequence's activations are
spread over ``c`` devices. megarl lays a packed (THD) micro-batch out as Megatron-Core and
TransformerEngine expect it:

1. each segment of the packed stream is padded at its end to a multiple of ``2 * c`` tokens, and the
   micro-batch to one length for every micro-batch of the call (Megatron's pipeline schedule sends
   one shape) with a padding segment;
2. each segment is cut into ``2 * c`` equal chunks; rank ``r`` holds chunks ``r`` and ``2c - 1 - r``
   (:func:`megarl.models.layers.context_chunks`), so every rank gets as much of the causal
   attention's work;
3. the model runs on the rank's tokens: RoPE gives each chunk its positions (Megatron's THD RoPE),
   attention all-gathers the keys and values of the group (megarl's ``SDPACoreAttention``;
   TransformerEngine's context-parallel attention where it runs);
4. the LM head (and a critic's value head) runs on the rank's tokens, and their per-token outputs
   are gathered back into the whole packed stream (:meth:`ContextSplit.gather`): losses, statistics
   and forward hooks see whole sequences, exactly as without context parallelism. Every rank of the
   group then computes the same loss; the gather's backward keeps the gradient of the rank's own
   tokens, and the data x context-parallel gradient all-reduce adds the ranks' parts up.

Padding never reaches a real token: it sits after the real tokens of its segment (causal
attention does not look ahead) and gathers back to nowhere.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from functools import cached_property

import torch

from megarl.models.layers import context_positions


@dataclass(frozen=True)
class ContextSplit:
    """How one packed micro-batch is split over a context-parallel group (see the module docstring).

    The micro-batch's own tensors (``MicroBatch.data``) stay in the unpadded packed stream of
    ``stream_len`` tokens; only the model sees the padded layout.
    """

    cu_seqlens: torch.Tensor
    """int32 segment bounds of the padded stream (every segment a multiple of ``2 * size``)."""
    max_seqlen: int
    """Longest padded segment (what the RoPE table must cover)."""
    padded_len: int
    """Tokens of the padded stream, over all ranks (Megatron's ``seq_length``)."""
    stream_len: int
    """Tokens of the micro-batch's unpadded stream (``MicroBatch.padded_len``)."""
    local_index: torch.Tensor = field(repr=False)
    """``[padded_len / size]`` where each of this rank's tokens sits in the unpadded stream; -1: padding."""
    gathered_index: torch.Tensor = field(repr=False)
    """``[padded_len]`` the same for every rank's tokens, rank after rank (the order of an all-gather)."""
    group: object = field(repr=False, default=None)
    """The context-parallel process group."""

    def to(self, device) -> ContextSplit:
        """This split with its index tensors on ``device`` (where the micro-batch's tensors are)."""
        return dataclasses.replace(
            self, local_index=self.local_index.to(device), gathered_index=self.gathered_index.to(device)
        )

    @cached_property
    def real(self) -> torch.Tensor:
        """bool ``[padded_len / size]``: which of this rank's tokens are the micro-batch's (not padding)."""
        return self.local_index >= 0

    @cached_property
    def _gathered_real(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of an all-gather that are the micro-batch's tokens, their places in the unpadded stream)."""
        rows = (self.gathered_index >= 0).nonzero().squeeze(-1)
        return rows, self.gathered_index.index_select(0, rows)

    def local(self, stream: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a per-token tensor of the unpadded stream (``[stream_len, ...]``);
        padding gets zeros (False)."""
        picked = stream.index_select(0, self.local_index.clamp(min=0).to(stream.device))
        real = self.real.to(stream.device).view(-1, *[1] * (stream.dim() - 1))
        return torch.where(real, picked, torch.zeros((), dtype=stream.dtype, device=stream.device))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of this rank's tokens (``[padded_len / size, ...]``) → the unpadded stream
        (``[stream_len, ...]``) from every rank's. Differentiable: the backward hands this rank the
        gradient of its own tokens (every rank must compute the same function of the result)."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        dtype = local.dtype
        if dtype == torch.bool:  # collectives move numbers
            local = local.to(torch.uint8)
        everyone = gather_from_sequence_parallel_region(
            local.contiguous(), tensor_parallel_output_grad=False, group=self.group
        )
        rows, places = (x.to(local.device) for x in self._gathered_real)
        out = torch.zeros((self.stream_len, *local.shape[1:]), dtype=local.dtype, device=local.device)
        return out.index_copy(0, places, everyone.index_select(0, rows)).to(dtype)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the group; the backward passes the gradient through as is (every rank
        computes the same function of the sum, and each differentiates its own part)."""
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(value, group=self.group)


def padded_length(lengths: list[int], size: int) -> int:
    """Tokens of sequences of ``lengths`` once each is padded to a multiple of ``2 * size``."""
    return sum(_padded(n, size) for n in lengths)


def split_for_context(
    lengths: list[int], stream_len: int, padded_len: int, size: int, rank: int, group
) -> ContextSplit:
    """A packed stream of ``stream_len`` tokens that starts with sequences of ``lengths`` (the rest is
    padding), laid out over a context-parallel group of ``size`` ranks in a padded stream of
    ``padded_len`` tokens (a multiple of ``2 * size``, at least :func:`padded_length`), for rank ``rank``."""
    padded_lengths, index, offset = [], [], 0
    for length in lengths:
        padded_lengths.append(_padded(length, size))
        index += list(range(offset, offset + length)) + [-1] * (padded_lengths[-1] - length)
        offset += length
    if padded_len > len(index):  # the padding segment
        padded_lengths.append(padded_len - len(index))
        index += [-1] * (padded_len - len(index))
    cu = [0, *itertools.accumulate(padded_lengths)]
    stream_index = torch.tensor(index, dtype=torch.long)
    gathered = [stream_index[context_positions(cu, size, r)] for r in range(size)]
    return ContextSplit(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(padded_lengths),
        padded_len=padded_len,
        stream_len=stream_len,
        local_index=gathered[rank],
        gathered_index=torch.cat(gathered),
        group=group,
    )


def _padded(length: int, size: int) -> int:
    return length + (-length) % (2 * size)
