"""Sliding windows read from HF configs, as Megatron's settings (the attention itself:
``test_packed_attention.py``; against HF and vLLM: ``tests/actor/test_parity.py``,
``tests/serving/test_sliding_window_served.py``)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from megarl.models.build import _window_kwargs
from megarl.models.families import SlidingWindow, sliding_window

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize(
    "config, window",
    [
        (MistralConfig(**SMALL, sliding_window=8), SlidingWindow(8, (True,) * 4)),
        (MistralConfig(**SMALL), SlidingWindow(4096, (True,) * 4)),  # transformers' default for Mistral
        (MistralConfig(**SMALL, sliding_window=None), None),
        (LlamaConfig(**SMALL), None),
        (Qwen2Config(**SMALL, sliding_window=8), None),  # use_sliding_window false: Qwen2 keeps the key unused
        (
            Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=2),
            SlidingWindow(8, (False, False, True, True)),
        ),
    ],
    ids=["mistral", "mistral-default", "mistral-none", "llama", "qwen2-off", "qwen2-from-layer-2"],
)
def test_the_window_and_its_layers_come_from_the_config(config, window):
    assert sliding_window(config) == window


def test_megatron_gets_the_keys_before_each_query_and_the_layers_that_slide():
    every = MistralConfig(**SMALL, sliding_window=8)
    assert _window_kwargs(every) == {"window_size": (7, 0), "window_attn_skip_freq": None}
    some = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=3)
    assert _window_kwargs(some) == {"window_size": (7, 0), "window_attn_skip_freq": [0, 0, 0, 1]}
    assert _window_kwargs(LlamaConfig(**SMALL)) == {}


def test_a_malformed_window_is_refused_by_name():
    config = MistralConfig(**SMALL, sliding_window=8)
    config.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window 0 must be a positive number"):
        sliding_window(config)
    config.sliding_window = 8
    config.layer_types = ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types .* 'sliding_attention' or 'full_attention'"):
        sliding_window(config)
