"""Sliding windows read from HF configs, as Megatron's setting (the attention itself:
``test_packed_attention.py``; against HF and vLLM: ``tests/actor/test_parity.py``,
``tests/serving/test_served_model_config.py``)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from megarl.models.build import _window_kwargs
from megarl.models.families import sliding_window

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize(
    "config, window",
    [
        (MistralConfig(**SMALL, sliding_window=8), 8),
        (MistralConfig(**SMALL), 4096),  # transformers' default for Mistral
        (MistralConfig(**SMALL, sliding_window=None), None),
        (LlamaConfig(**SMALL), None),
        (Qwen2Config(**SMALL, sliding_window=8), None),  # use_sliding_window false: Qwen2 keeps the key unused
    ],
    ids=["mistral", "mistral-default", "mistral-none", "llama", "qwen2-off"],
)
def test_the_window_comes_from_the_config(config, window):
    assert sliding_window(config) == window


def test_megatron_gets_the_keys_before_each_query():
    assert _window_kwargs(MistralConfig(**SMALL, sliding_window=8)) == {"window_size": (7, 0)}
    assert _window_kwargs(LlamaConfig(**SMALL)) == {}


def test_windows_megarl_cannot_serve_or_hold_are_refused_by_name():
    qwen2 = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    with pytest.raises(ValueError, match="use_sliding_window: true is not supported.*max_window_layers"):
        sliding_window(qwen2)
    config = MistralConfig(**SMALL, sliding_window=8)
    config.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window 0 must be a positive number"):
        sliding_window(config)
    config.sliding_window = 8
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    with pytest.raises(
        ValueError, match=r"layer_types \['full_attention', 'sliding_attention'\]: a sliding window on some"
    ):
        sliding_window(config)
