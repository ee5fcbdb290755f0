"""Vocab-parallel fused_logprobs_entropy over a real 2-rank gloo group equals the single-rank result.

Both are float32 computations of the same exact values: each is within the head's error bound
(``tests/numerics.py``) of them, so the two are within twice that bound of each other."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.kernels import fused_logprobs_entropy
from tests.numerics import assert_within, softmax_head_bounds

WORLD = 2
# (rows per rank, real vocab size): rank 1 holds 5 real rows + 1 padding row; then a case
# where rank 1's shard is all padding (its local max is -inf).
CASES = [(6, 11), (4, 3)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(rows: int, vocab: int):
    g = torch.Generator().manual_seed(rows * 100 + vocab)
    T, H = 13, 8
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(rows * WORLD, H, generator=g) * 0.7  # [V_padded,H]
    labels = torch.randint(0, vocab, (T,), generator=g)
    labels[0] = -100  # ignored
    labels[1] = vocab - 1  # the last real id (rank 1 when it has real rows)
    coefs = torch.randn(2, T, generator=g)
    return hidden, weight, labels, coefs


def _run(hidden, weight, labels, coefs, **kwargs):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    logp, ent = fused_logprobs_entropy(hidden, weight, labels, temperature=0.8, chunk_tokens=5, chunk_vocab=4, **kwargs)
    (coefs[0] * logp + coefs[1] * ent).sum().backward()
    return logp.detach(), ent.detach(), hidden.grad, weight.grad


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group([0, 1])
        for rows, vocab in CASES:
            hidden, weight, labels, coefs = _inputs(rows, vocab)
            want = _run(hidden, weight, labels, coefs, vocab_size=vocab)  # one rank, whole vocab
            shard = weight[rank * rows : (rank + 1) * rows]
            got = _run(hidden, shard, labels, coefs, tp_group=group, vocab_size=vocab)
            b = softmax_head_bounds(hidden, weight[:vocab], labels, coefs, 0.8, torch.float32) * 2
            assert_within(got[0], want[0], b.logprob, "logprob")
            assert_within(got[1], want[1], b.entropy, "entropy")
            assert_within(got[2], want[2], b.d_hidden, "all-reduced grad_hidden")
            own = slice(rank * rows, min((rank + 1) * rows, vocab))  # this rank's real vocabulary rows
            n_own = max(own.stop - own.start, 0)
            assert_within(got[3][:n_own], want[3][own], b.d_weight[own], "grad_weight")
            assert torch.all(got[3][n_own:] == 0) and torch.all(want[3][vocab:] == 0), "padding rows get no gradient"

            # Without the built-in reduction each rank holds its shard's share; they sum to the whole.
            partial = _run(hidden, shard, labels, coefs, tp_group=group, vocab_size=vocab, reduce_grad_hidden=False)[2]
            dist.all_reduce(partial, group=group)
            assert_within(partial, want[2], b.d_hidden, "summed partial grad_hidden")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_two_rank_vocab_parallel_equals_single_rank():
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD, join=True)
