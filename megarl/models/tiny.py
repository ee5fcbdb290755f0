"""Tiny random HF models with a real tokenizer, one per supported family, for tests.

Shapes are small but keep every feature a weight mapping must get right: GQA (4 query
heads, 2 KV heads, so TP=2 splits KV groups), head_dim 64 decoupled from hidden/heads
(vLLM-CPU rejects head_dim 16), QKV bias (qwen2), QK norm (qwen3, qwen3_moe), experts
(qwen3_moe), a sliding attention window of 4 tokens (mistral: shorter than the tests' sequences, so
that they cross it) and 4 layers (PP=2 x VPP=2). Biases and norm weights are randomised too, so
that a mapping which drops or swaps them changes the logits.
"""

from __future__ import annotations

import logging
import os
import types
from pathlib import Path

logger = logging.getLogger(__name__)

TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

_COMMON = types.MappingProxyType(
    {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
)
_FAMILY = types.MappingProxyType(
    {
        "llama": {},
        "mistral": {"sliding_window": 4},
        "qwen2": {},  # Qwen2 attention always has q/k/v biases
        "qwen3": {"attention_bias": False},  # Qwen3 attention always has q/k norms
        "qwen3_moe": {
            "attention_bias": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
        },
    }
)


def tiny_config(family: str, tokenizer, **overrides):
    """The HF config of a tiny ``family`` model whose vocab and special ids match ``tokenizer``."""
    from transformers import AutoConfig

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; known: {list(TINY_FAMILIES)}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = {
        **_COMMON,
        **_FAMILY[family],
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": pad_id,
        **overrides,
    }
    return AutoConfig.for_model(family, **kwargs)


def make_tiny_model(
    family: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    tokenizer_from: str | None = None,
    **config_overrides,
) -> Path:
    """Write a random ``family`` model (float32 safetensors) plus tokenizer to ``out_dir``.

    The tokenizer is taken from the HF directory ``tokenizer_from`` (default: the
    provisioned SmolLM2, vocab 49152). Same ``seed`` and arguments give the same weights.
    ``config_overrides`` replace config fields (e.g. ``tie_word_embeddings=True``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.models.provision import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from or resolve_model_path("smollm2"))
    config = tiny_config(family, tokenizer, **config_overrides)
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_biases_and_norms(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("tiny %s model (seed %d) written to %s", family, seed, out)
    return out


def _randomise_biases_and_norms(model, seed: int) -> None:
    """HF inits biases to 0 and norms to 1: values a broken mapping would still reproduce."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
