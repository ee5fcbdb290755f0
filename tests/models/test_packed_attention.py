"""SDPACoreAttention on packed batches: padded buckets give exactly the per-sequence attention,
through torch's SDPA and through the grouped math path that short rows take on CPU.

The reference attends each segment on its own with an explicit causal mask (over its prefix's
keys too, for a shared-prefix branch), in plain torch, float64 like the layer under test: the
two differ only in summation order (error ~ n u |terms|, u = 1.1e-16), so any indexing or
masking mistake shows as a difference many orders of magnitude above the tolerance.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from megarl.models import layers
from megarl.models.layers import PaddedAttentionPlan, SDPACoreAttention, SharedPrefixSeqParams

HEADS, KV_HEADS, DIM = 4, 2, 8
TOL = dict(rtol=1e-9, atol=1e-9)  # float64 on both sides


def _layer(dropout: float = 0.0, window: int | None = None) -> SDPACoreAttention:
    window_size = None if window is None else (window - 1, 0)  # as megarl.models.build sets it
    config = SimpleNamespace(
        context_parallel_size=1, attention_dropout=dropout, window_size=window_size, window_attn_skip_freq=None
    )
    return SDPACoreAttention(config, layer_number=1, attn_mask_type=None, attention_type="self")


def _reference(q, k, v, cu_seqlens, parents, window=None):
    """Per segment: queries = its own tokens; keys = its parent's tokens then its own; causal and,
    with a sliding ``window``, the last ``window`` positions only (HF's rule)."""
    spans = list(itertools.pairwise(cu_seqlens))
    out = torch.empty(q.shape[0], HEADS * DIM, dtype=q.dtype)
    for i, (start, end) in enumerate(spans):
        own = list(range(start, end))
        keys = (list(range(*spans[parents[i]])) if parents and parents[i] is not None else []) + own
        qi = q[own].transpose(0, 1)  # [n, s, d]
        ki = k[keys].repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
        vi = v[keys].repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
        scores = qi @ ki.transpose(1, 2) / math.sqrt(DIM)
        prefix = len(keys) - len(own)
        distance = prefix + torch.arange(len(own))[:, None] - torch.arange(len(keys))[None, :]
        visible = (distance >= 0) & (distance < (window or len(keys)))
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vi).transpose(0, 1).reshape(len(own), -1)
    return out


def _inputs(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(tokens, HEADS, DIM), (tokens, KV_HEADS, DIM), (tokens, KV_HEADS, DIM)]
    return [torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]


CASES = {
    # lengths spread over several buckets, a one-token sequence among them
    "packed": ([0, 5, 6, 23, 32, 62, 64, 75, 100], ()),
    # GRPO-style: prompts 0 and 4, each continued by branches (one of a single token)
    "shared-prefix": ([0, 6, 9, 16, 17, 21, 26, 38, 41], (None, 0, 0, 0, None, 4, 4, None)),
}


PATHS = {"sdpa": 0, "grouped-math": layers.CPU_MATH_ATTENTION_MAX_KEYS}
"""``CPU_MATH_ATTENTION_MAX_KEYS`` for each path (every row of these cases has fewer keys than the default)."""


@pytest.mark.parametrize("window", [None, 4, 9], ids=["causal", "window-4", "window-9"])
@pytest.mark.parametrize("path", PATHS, ids=list(PATHS))
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_padded_buckets_equal_per_sequence_attention(monkeypatch, case, path, window):
    """Also with a sliding window shorter than most rows (Mistral's), across a shared prefix too:
    a branch's first queries still see the prefix's last keys."""
    monkeypatch.setattr(layers, "CPU_MATH_ATTENTION_MAX_KEYS", PATHS[path])
    cu_seqlens, parents = CASES[case]
    params = SharedPrefixSeqParams(cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32), parents=parents)
    q, k, v = _inputs(cu_seqlens[-1])
    got = _layer(window=window).forward(q, k, v, None, packed_seq_params=params)
    want = _reference(q, k, v, cu_seqlens, parents, window)
    torch.testing.assert_close(got, want, **TOL)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for name, g, w in zip("qkv", grads, want_grads):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, name=name: f"d{name}: {m}")
    assert all(g.isfinite().all() for g in grads)  # padding queries see a key in every window
    assert len(PaddedAttentionPlan.of(params, q.device, window).buckets) > 1  # several buckets were exercised


def test_an_rl_batch_of_short_answers_is_a_few_calls_with_bounded_padding():
    """56 sequences of 17-28 tokens (the arithmetic job's batch): a few SDPA calls, not 56,
    and padded key rows at most GROWTH times the longest real key length of each bucket."""
    lengths = torch.randint(17, 29, (56,), generator=torch.Generator().manual_seed(0)).tolist()
    cu = [0, *itertools.accumulate(lengths)]
    plan = PaddedAttentionPlan.build(cu, (), "cpu")
    assert len(plan.buckets) <= 3
    assert sum(b.query_rows.shape[0] for b in plan.buckets) == 56
    padded = sum(b.query_rows.numel() for b in plan.buckets)
    assert padded <= PaddedAttentionPlan.GROWTH * sum(lengths)
    assert sorted(plan.token_rows.tolist()) == plan.token_rows.unique().tolist()  # one row per token


@pytest.mark.parametrize("window", [None, 5, 13], ids=["causal", "window-5", "window-of-the-row"])
@pytest.mark.parametrize("path", PATHS, ids=list(PATHS))
def test_a_plain_batch_is_causal_attention_per_row(monkeypatch, path, window):
    """Without packing ([s, b, n, hn]): each row attends causally to itself (in its sliding window), as
    SDPA's reference math."""
    monkeypatch.setattr(layers, "CPU_MATH_ATTENTION_MAX_KEYS", PATHS[path])
    s, b = 13, 3
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(s, b, n, DIM, generator=gen, dtype=torch.float64) for n in (HEADS, KV_HEADS, KV_HEADS))
    got = _layer(window=window).forward(q, k, v, None)
    for row in range(b):
        spans = [0, s]
        want = _reference(q[:, row], k[:, row], v[:, row], spans, (), window)
        torch.testing.assert_close(got[:, row], want, **TOL)


@pytest.mark.parametrize(
    "window_size, skip, windows",
    [
        (None, None, [None, None, None]),
        ((7, 0), None, [8, 8, 8]),
        ((7, 0), [0, 1, 1], [None, 8, 8]),  # Megatron's per-layer flags (megarl's builds slide every layer)
    ],
)
def test_each_layer_takes_its_window_from_megatrons_settings(window_size, skip, windows):
    config = SimpleNamespace(
        context_parallel_size=1, attention_dropout=0.0, window_size=window_size, window_attn_skip_freq=skip
    )
    got = [SDPACoreAttention(config, n, None, "self").window for n in (1, 2, 3)]
    assert got == windows


def test_a_window_that_sees_later_tokens_is_refused():
    config = SimpleNamespace(
        context_parallel_size=1, attention_dropout=0.0, window_size=(7, 2), window_attn_skip_freq=None
    )
    with pytest.raises(ValueError, match=r"window_size \(7, 2\): only causal windows"):
        SDPACoreAttention(config, 1, None, "self")


@pytest.mark.parametrize(
    "keys, dropout, flash",
    [(40, 0.0, False), (layers.CPU_MATH_ATTENTION_MAX_KEYS + 1, 0.0, True), (40, 0.1, True)],
    ids=["short rows: grouped math", "long rows: SDPA", "dropout: SDPA"],
)
def test_short_rows_on_cpu_skip_the_flash_kernel(monkeypatch, keys, dropout, flash):
    """Rows of at most CPU_MATH_ATTENTION_MAX_KEYS keys, without dropout, are two batched GEMMs and a
    softmax on CPU (faster than the flash kernel there); longer rows and dropout stay with SDPA."""
    calls = []
    sdpa = layers.F.scaled_dot_product_attention
    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    q, k, v = (torch.randn(keys, 2, n, DIM) for n in (HEADS, KV_HEADS, KV_HEADS))
    _layer(dropout).train().forward(q, k, v, None)
    assert bool(calls) == flash


def test_grouped_math_attention_gives_bf16_inputs_bf16_outputs_computed_in_fp32():
    """A bf16 layer attends in fp32 (CPU_ATTENTION_IN_FP32) on either path: the same result up to the
    final rounding to bf16."""
    q, k, v = (torch.randn(17, 2, n, DIM, dtype=torch.float64) for n in (HEADS, KV_HEADS, KV_HEADS))
    want = _layer().forward(*(x.bfloat16().double() for x in (q, k, v)), None)
    got = _layer().forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-6)
