"""What ``describe`` refuses in an HF config, naming the setting (no weights needed)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen2Config

from megarl.models.build import describe

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_a_plain_llama_is_described():
    desc = describe(LlamaConfig(**SMALL, vocab_size=101), tp=2)
    assert (desc.family.name, desc.dims.head_dim, desc.dims.padded_vocab_size) == ("llama", 16, 102)


@pytest.mark.parametrize(
    "config, message",
    [
        (LlamaConfig(**SMALL, attention_bias=True), r"attention_bias: true \(q/k/v/o projection biases\)"),
        (LlamaConfig(**SMALL, mlp_bias=True), r"mlp_bias: true \(MLP projection biases\)"),
        (LlamaConfig(**SMALL, hidden_act="gelu"), r"hidden_act 'gelu' is not supported"),
        (Qwen2Config(**{**SMALL, "num_key_value_heads": 1}), r"tensor parallel size 2 must divide"),
        (
            LlamaConfig(
                **SMALL, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
            ),
            r"rope_type 'yarn'",
        ),
    ],
    ids=["attention-bias", "mlp-bias", "gelu", "tp-over-kv-heads", "yarn"],
)
def test_what_the_layers_cannot_hold_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        describe(config, tp=2)
