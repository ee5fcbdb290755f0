"""Tiny random HF models: shapes and features per family, determinism, generation."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megarl.models import TINY_FAMILIES, make_tiny_model


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_loads_and_generates(tiny_model_dir, family):
    model, tokenizer = load(tiny_model_dir(family))
    config = model.config
    assert config.model_type == family
    assert config.head_dim == 64 and config.num_key_value_heads < config.num_attention_heads
    assert config.vocab_size == len(tokenizer) == 49152
    assert (config.eos_token_id, config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (config.num_attention_heads * 64, config.hidden_size)
    assert attn.k_proj.weight.shape == (config.num_key_value_heads * 64, config.hidden_size)

    ids = tokenizer("Tiny models still", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids["input_ids"].shape[1] + 4)
    assert isinstance(tokenizer.decode(out[0]), str)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_family_features(tiny_model_dir, family):
    weights = load_file(tiny_model_dir(family) / "model.safetensors")
    layer = "model.layers.0."
    has = {name[len(layer) :] for name in weights if name.startswith(layer)}
    qkv_bias = {f"self_attn.{p}_proj.bias" for p in "qkv"}
    qk_norm = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    assert (qkv_bias <= has) == (family == "qwen2")
    assert (qk_norm <= has) == (family in ("qwen3", "qwen3_moe"))
    if family == "qwen2":  # randomised, so a mapping that drops a bias changes the output
        assert all(weights[layer + b].abs().sum() > 0 for b in qkv_bias)
    if family == "qwen3_moe":
        # Saved per expert, the layout of released checkpoints that vLLM and bridges read.
        assert {f"mlp.experts.{e}.gate_proj.weight" for e in range(4)} <= has
        assert weights[layer + "mlp.gate.weight"].shape == (4, 128)
        assert weights[layer + "mlp.experts.0.down_proj.weight"].shape == (128, 128)
    assert not any(n.startswith("mlp.experts") for n in has) or family == "qwen3_moe"
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_same_seed_same_weights_and_other_seed_differs(tiny_model_dir, smollm2_dir, tmp_path):
    reference = load_file(tiny_model_dir("llama") / "model.safetensors")
    again = load_file(make_tiny_model("llama", tmp_path / "a", tokenizer_from=str(smollm2_dir)) / "model.safetensors")
    other = load_file(
        make_tiny_model("llama", tmp_path / "b", seed=1, tokenizer_from=str(smollm2_dir)) / "model.safetensors"
    )
    assert reference.keys() == again.keys()
    assert all(torch.equal(reference[k], again[k]) for k in reference)
    assert not torch.equal(reference["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_config_overrides_apply(tiny_model_dir):
    model, _ = load(tiny_model_dir("qwen3", tie_word_embeddings=True, num_hidden_layers=2))
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_unknown_family_is_rejected(smollm2_dir, tmp_path):
    with pytest.raises(ValueError, match=r"unknown tiny model family 'gpt2'.*'qwen3_moe'"):
        make_tiny_model("gpt2", tmp_path, tokenizer_from=str(smollm2_dir))
