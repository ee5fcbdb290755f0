"""megarl.models.flops: the FLOPs a training pass is counted for, checked against the model itself."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from megarl.models.flops import MatmulShape, peak_bf16_flops, train_flops


def _matrix_params(model: torch.nn.Module) -> int:
    """Every weight matrix of ``model`` but the embedding's (experts stacked or not; the router's
    included); norms and biases are vectors."""
    return sum(p.numel() for name, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in name)


def test_a_dense_models_matmul_params_are_its_weight_matrices():
    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=500,
        tie_word_embeddings=False,
    )
    shape = MatmulShape.from_hf_config(config)
    assert shape.matmul_params == _matrix_params(Qwen2ForCausalLM(config))  # the LM head included


def test_an_moe_token_passes_through_its_top_k_experts_and_the_router():
    config = Qwen3MoeConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=500,
        tie_word_embeddings=False,
    )
    shape = MatmulShape.from_hf_config(config)
    every_expert = _matrix_params(Qwen3MoeForCausalLM(config))
    idle = 2 * (8 - 2) * 3 * 64 * 48  # per layer, the 6 experts (gate, up, down) a token does not visit
    assert shape.matmul_params == every_expert - idle
    assert shape.head_dim == 32  # Qwen3's head_dim is its own, not hidden / heads


def test_attention_flops_grow_with_each_sequences_square_and_megatron_counts_the_full_scores():
    shape = MatmulShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_width=96, vocab=100)
    dense = 6 * shape.matmul_params
    assert train_flops(shape, [10]) == dense * 10 + 6 * 2 * 64 * 10**2
    assert train_flops(shape, [10], "megatron") == dense * 10 + 12 * 2 * 64 * 10**2
    # two sequences of 5 tokens attend over 5 each: half the score FLOPs of one of 10
    attention = train_flops(shape, [10]) - dense * 10
    assert train_flops(shape, [5, 5]) == dense * 10 + attention / 2
    with pytest.raises(ValueError, match="convention 'full'"):
        train_flops(shape, [10], "full")


def test_a_sliding_window_counts_the_scores_its_queries_compute():
    """Mistral's window of 4 over a sequence of 10: 2 x (10 x 4 - 4^2 / 2) scores in place of 10^2 in
    the causal count; Megatron's count is the full square whatever the window. A sequence no longer
    than the window counts as without one."""
    from transformers import MistralConfig

    sizes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    config = MistralConfig(**sizes, num_key_value_heads=2, head_dim=16, vocab_size=100, sliding_window=4)
    shape = MatmulShape.from_hf_config(config)
    assert shape.window == 4
    plain = MatmulShape.from_hf_config(MistralConfig(**{**config.to_dict(), "sliding_window": None}))
    dense = 6 * shape.matmul_params
    assert train_flops(shape, [10]) == dense * 10 + 6 * 2 * 64 * (2 * 10 * 4 - 4 * 4)
    assert train_flops(shape, [10], "megatron") == train_flops(plain, [10], "megatron")
    assert train_flops(shape, [4, 3]) == train_flops(plain, [4, 3])


def test_peaks_by_device_name():
    assert peak_bf16_flops("NVIDIA H200") == peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H20") == 148e12  # not the H200's
    assert peak_bf16_flops("NVIDIA GB200") == 2500e12 and peak_bf16_flops("NVIDIA B200") == 2250e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("cpu") is None and peak_bf16_flops("Tesla T4") is None
