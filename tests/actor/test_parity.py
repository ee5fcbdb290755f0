"""Parallel parity on CPU (gloo): every layout gives the single-rank model's logprobs, loss and gradients.

References: the single-rank Megatron model (d1p1t1), itself checked against the HF
transformers model on the same batch and loss (logprobs within 1e-4, gradients within
1e-4 relative). Layouts: TP2, PP2, PP2 x VPP2, TP2 x PP2, and context parallel CP2 alone and
with TP2, PP2, PP2 x VPP2 or DP2 (Llama); EP2, EP2 x TP2 with ETP1 and EP2 x CP2 (Qwen3-MoE).
Each layout's logprobs must be within 1e-5 of the reference (fp32), its one-step PPO loss and
gathered gradients must match, and so must the logprobs after the Adam step. Data parallel ranks get rows ``rank::dp`` of the batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.actor.dist_utils import assert_grads_close, dp_rows, run_layout, run_ranks
from tests.actor.workers import make_batch, make_grouped_batch

pytestmark = pytest.mark.multiproc

LENGTHS = [7, 12, 5, 9, 11, 6]
LOGP_TOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def batch():
    return make_batch(LENGTHS, seed=3)


def _run(model_dir, alloc: str, batch, **kwargs) -> dict:
    """Run ``parity_run`` on every rank of ``alloc``; merge DP rows and per-stage gradients."""
    results = run_layout(alloc, "tests.actor.workers:parity_run", model_dir=str(model_dir), batch=batch, **kwargs)
    merged = {
        "loss": [r["loss"] for r in results],
        "grad_norm": [r["grad_norm"] for r in results],
        "grads": {},
        "packed_tokens": [r["packed_tokens"] for r in results],
    }
    for key in ("logp", "logp_after", "logp_unpacked"):
        if key in results[0]:
            merged[key] = dp_rows(results, key, batch["input_ids"].shape)
    for r in results:
        merged["grads"].update(r["grads"])
    return merged


def _hf_reference(model_dir, batch) -> dict:
    """Logprobs, token-mean PPO loss and gradients of the HF transformers model on ``batch``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    logits = model(ids, attention_mask=attn).logits.float()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * attn[:, 1:]
    mask = batch["loss_mask"][:, 1:].bool() & attn[:, 1:]
    ratio = torch.exp(logp - batch["logprobs"][:, 1:])
    adv = batch["advantages"][:, 1:]
    surr = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    loss = (surr * mask).sum() / mask.sum()
    loss.backward()
    grads = _disk_names({name: p.grad.detach().clone() for name, p in model.named_parameters()})
    padded = torch.zeros_like(batch["logprobs"])
    padded[:, :-1] = logp.detach()
    return {"logp": padded, "loss": loss.item(), "grads": grads}


def _disk_names(tensors: dict) -> dict:
    """transformers 5 fuses MoE experts in memory ([E, 2I, H] gate_up, [E, H, I] down); split per expert."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def _assert_matches(layout: dict, ref: dict) -> None:
    assert (layout["logp"] - ref["logp"]).abs().max() <= LOGP_TOL
    assert all(abs(loss - ref["loss"][0]) <= 1e-6 * max(1.0, abs(ref["loss"][0])) for loss in layout["loss"])
    assert_grads_close(layout["grads"], ref["grads"], GRAD_RTOL)
    assert all(norm == pytest.approx(ref["grad_norm"][0], rel=1e-5) for norm in layout["grad_norm"])
    assert (layout["logp_after"] - ref["logp_after"]).abs().max() <= 10 * LOGP_TOL


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir):
    return tiny_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def llama_ref(llama_dir, batch):
    return _run(llama_dir, "d1p1t1", batch, unpacked_too=True)


@pytest.fixture(scope="module")
def moe_ref(moe_dir, batch):
    return _run(moe_dir, "d1p1t1", batch)


@pytest.mark.parametrize("which", ["llama", "moe"])
def test_single_rank_megatron_matches_hf(request, batch, which):
    ref = request.getfixturevalue(f"{which}_ref")
    hf = _hf_reference(request.getfixturevalue(f"{which}_dir"), batch)
    assert (ref["logp"] - hf["logp"]).abs().max() <= 1e-4
    assert abs(ref["loss"][0] - hf["loss"]) <= 1e-5
    assert_grads_close(ref["grads"], hf["grads"], 1e-4)


def test_packed_and_unpacked_logprobs_agree(llama_ref):
    assert (llama_ref["logp"] - llama_ref["logp_unpacked"]).abs().max() <= LOGP_TOL
    assert llama_ref["logp"].abs().sum() > 0


@pytest.mark.parametrize(
    "alloc",
    [
        # TP2 and PP2 alone: d1p2t2 has both (and d1p2t1v2 the pipeline schedule), in `make test`
        pytest.param("d1p1t2", marks=pytest.mark.slow),
        pytest.param("d1p2t1", marks=pytest.mark.slow),
        "d1p2t1v2",
        "d1p2t2",
        pytest.param("d2p1t1", marks=pytest.mark.slow),
        "d1p1t1c2",
        "d1p1t2c2",
        pytest.param("d1p2t1c2", marks=pytest.mark.slow),
        pytest.param("d1p2t1v2c2", marks=pytest.mark.slow),
        pytest.param("d2p1t1c2", marks=pytest.mark.slow),
    ],
)
def test_llama_layout_matches_single_rank(llama_dir, llama_ref, batch, alloc):
    _assert_matches(_run(llama_dir, alloc, batch, n_mbs=2), llama_ref)


# EP2 alone runs with the slow tests: d1p1t2e2et1 has the same two expert ranks, with TP2 and sequence parallelism.
# d2p1t2e2et1 holds two copies of each expert (expert data parallel 2; the 256-GPU preset has eight), whose
# gradients and Adam state the distributed optimizer shards over the two; d1p2t2e2et1 splits the layers over two
# pipeline stages as well.
@pytest.mark.parametrize(
    "alloc,dispatcher,distributed_optimizer",
    [
        pytest.param("d2p1t1e2", "alltoall", False, marks=pytest.mark.slow),
        ("d1p1t2e2et1", "alltoall", False),
        ("d1p1t2e2et1", "allgather", False),
        ("d1p1t1e2c2", "alltoall", False),
        ("d2p1t2e2et1", "alltoall", True),
        ("d1p2t2e2et1", "alltoall", True),  # experts over EP on each of two pipeline stages, as the MoE presets
        ("d2p1t2e2", "alltoall", False),  # each expert split over expert TP 2 as well
        ("d2p1t2e2", "allgather", False),
    ],
)
def test_moe_layout_matches_single_rank(moe_dir, moe_ref, batch, alloc, dispatcher, distributed_optimizer):
    run = _run(
        moe_dir,
        alloc,
        batch,
        n_mbs=2,
        moe_token_dispatcher_type=dispatcher,
        distributed_optimizer=distributed_optimizer,
    )
    _assert_matches(run, moe_ref)


def _hf_logp(model_dir, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = model(ids, attention_mask=attn).logits.float()
    out = torch.zeros(ids.shape)
    out[:, :-1] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * attn[:, 1:]
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_family_at_tp2_matches_hf(tiny_model_dir, batch, family):
    """The tiny mistral's sliding window (4 tokens) is shorter than most of the batch's rows."""
    model_dir = tiny_model_dir(family)
    results = run_ranks(2, "tests.actor.workers:logprobs", model_dir=str(model_dir), alloc="d1p1t2", batch=batch)
    want = _hf_logp(model_dir, batch)
    assert all((logp - want).abs().max() <= 1e-4 for logp in results)


def test_tied_embeddings_and_padded_vocab_over_tp_and_pp(tiny_model_dir, batch, tmp_path):
    """Vocab 49153 pads to 49154 at TP2 (padded rows out of the softmax); the tied head lives on both stages."""
    import filecmp

    model_dir = tiny_model_dir("llama", tie_word_embeddings=True, vocab_size=49153)
    results = run_ranks(
        4,
        "tests.actor.workers:logprobs_and_export",
        model_dir=str(model_dir),
        alloc="d1p2t2",
        batch=batch,
        export_dir=str(tmp_path / "out"),
    )
    want = _hf_logp(model_dir, batch)
    assert all((logp - want).abs().max() <= 1e-4 for logp in results)
    assert filecmp.cmp(model_dir / "model.safetensors", tmp_path / "out" / "model.safetensors", shallow=False)


def test_a_sliding_window_over_shared_prefixes_matches_hf(tiny_model_dir, grouped_batch):
    """Mistral's window (4 tokens) is shorter than the groups' prompts (12): a branch's first tokens see
    only the prompt's last keys, in megarl's packing as in HF's padded batch."""
    model_dir = tiny_model_dir("mistral")
    got = _run(model_dir, "d1p1t1", grouped_batch, share_prefix=True, n_mbs=2)
    hf = _hf_reference(model_dir, grouped_batch)
    assert (got["logp"] - hf["logp"]).abs().max() <= 1e-4
    assert all(abs(loss - hf["loss"]) <= 1e-5 for loss in got["loss"])
    assert_grads_close(got["grads"], hf["grads"], 1e-4)


@pytest.fixture(scope="module")
def grouped_batch():
    return make_grouped_batch(n_groups=3, group=4, prompt_len=12, seed=5)


@pytest.mark.parametrize(
    "alloc", ["d1p1t1", pytest.param("d1p1t2", marks=pytest.mark.slow), pytest.param("d1p2t1", marks=pytest.mark.slow)]
)
def test_shared_prefixes_match_hf(llama_dir, grouped_batch, alloc):
    """GRPO groups packed with their prompt once (``mb_spec.share_prefix``): the HF model's
    logprobs, loss and gradients on the padded batch, from a third fewer tokens. TP2 runs with
    sequence parallelism, PP2 passes the branch positions to the second stage."""
    got = _run(llama_dir, alloc, grouped_batch, share_prefix=True, n_mbs=2)
    hf = _hf_reference(llama_dir, grouped_batch)
    seqlens = grouped_batch["attention_mask"].sum().item()
    assert max(got["packed_tokens"]) <= seqlens - 3 * 3 * 10  # 3 of each 4 rows skip 10 prompt tokens
    assert (got["logp"] - hf["logp"]).abs().max() <= 1e-4
    assert all(abs(loss - hf["loss"]) <= 1e-5 for loss in got["loss"])
    assert_grads_close(got["grads"], hf["grads"], 1e-4)


def test_context_parallel_over_rows_past_the_math_path_matches_single_rank(llama_dir):
    """Rows longer than ``CPU_MATH_ATTENTION_MAX_KEYS`` go through torch's flash kernel with a mask; odd
    lengths pad each row to a multiple of 2 x c (the padding never reaches a real token)."""
    long_batch = make_batch([151, 37, 263, 9], seed=4)
    _assert_matches(_run(llama_dir, "d1p1t1c2", long_batch, n_mbs=2), _run(llama_dir, "d1p1t1", long_batch, n_mbs=2))


def test_context_parallel_with_a_sliding_window_matches_hf(tiny_model_dir, batch):
    """Mistral's window (4 tokens) is shorter than a rank's chunks: each rank's queries see the keys of
    the other rank's chunks only inside the window."""
    model_dir = tiny_model_dir("mistral")
    got = _run(model_dir, "d1p1t1c2", batch, n_mbs=2)
    hf = _hf_reference(model_dir, batch)
    assert (got["logp"] - hf["logp"]).abs().max() <= 1e-4
    assert all(abs(loss - hf["loss"]) <= 1e-5 for loss in got["loss"])
    assert_grads_close(got["grads"], hf["grads"], 1e-4)
