"""SmolLM2-135M-Instruct (9 heads, 3 KV heads, 30 layers, tied embeddings) in Megatron on CPU.

At TP1, TP3 and PP2 the model loads from its HF safetensors, scores a GSM8K question and
answer like the HF transformers model does, and exports back to a byte-identical
``model.safetensors``.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch

from megarl.config.allocation import AllocationMode
from tests.actor.dist_utils import run_ranks

pytestmark = pytest.mark.multiproc

GSM8K = Path(__file__).resolve().parents[2] / "megarl" / "data" / "gsm8k" / "test.jsonl"


@pytest.fixture(scope="module")
def gsm8k_batch(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:2]]
    seqs = []
    for row in rows:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": row["question"]}], tokenize=False, add_generation_prompt=True
        )
        seqs.append(tok(prompt + row["answer"])["input_ids"])
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = True
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def hf_logp(smollm2_dir, gsm8k_batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids, mask = gsm8k_batch["input_ids"], gsm8k_batch["attention_mask"]
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits.float()
    out = torch.zeros(ids.shape)
    out[:, :-1] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
    return out


# The real checkpoint's layouts take about a minute each: CI runs one rank, the slow tests TP3 and PP2
# (tests/actor/test_parity.py checks TP and PP on the tiny models in CI).
@pytest.mark.parametrize(
    "alloc", ["d1p1t1", pytest.param("d1p1t3", marks=pytest.mark.slow), pytest.param("d1p2t1", marks=pytest.mark.slow)]
)
def test_smollm2_logprobs_and_export_roundtrip(smollm2_dir, gsm8k_batch, hf_logp, tmp_path, alloc):
    world = AllocationMode.from_str(f"megatron:{alloc}").train.world_size
    out = tmp_path / "export"
    results = run_ranks(
        world,
        "tests.actor.workers:logprobs_and_export",
        timeout=600,
        model_dir=str(smollm2_dir),
        alloc=alloc,
        batch=gsm8k_batch,
        export_dir=str(out),
    )
    for logp in results:
        assert (logp - hf_logp).abs().max() <= 1e-4
    assert filecmp.cmp(Path(smollm2_dir) / "model.safetensors", out / "model.safetensors", shallow=False)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out))  # transformers loads the export
