"""Model FLOPs of a training pass, and MFU: what a step's throughput is against the hardware.

A token of a packed sequence of length S costs, forward and backward:

* ``6 N`` for the N matmul parameters it passes through: each layer's attention projections (Q, K,
  V, O) and MLP (gate, up, down; for an MoE model its routed experts' ``num_experts_per_tok`` and any
  shared expert, plus the router), and the LM head (vocabulary x hidden). Embedding lookups, norms
  and elementwise ops are not counted;
* attention's two matmuls (scores and the weighted sum of values): ``12 L S d`` per token with the
  full S x S scores (``d`` = heads x head_dim), Megatron-LM's convention (``convention="megatron"``),
  or ``6 L S d`` (``"causal"``, megarl's default): a causal mask leaves half of them out, and
  FlashAttention-style kernels skip that half. In a layer with a sliding window of W < S tokens
  (Mistral's ``sliding_window``) ``"causal"`` counts the scores a query computes, ``12 d (S W - W^2 / 2)``
  per sequence instead of ``6 d S^2``; Megatron-LM's formula counts S x S whatever the window.

MFU is model FLOPs per second over the device's dense bf16 peak (:func:`peak_bf16_flops`). As
Megatron and NeMo-RL count it, the FLOPs are the model's (a recomputed forward is not counted).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from megarl.models.families import sliding_window

CONVENTIONS = ("causal", "megatron")

PEAK_BF16_TFLOPS = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
}
"""Dense bf16 tensor-core peaks (TFLOP/s, SXM parts, no sparsity) by the device name's model."""


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a device named ``device_name`` (``torch.cuda.get_device_name()``), None
    when unknown (a CPU, or a GPU model not in :data:`PEAK_BF16_TFLOPS`)."""
    for model, tflops in PEAK_BF16_TFLOPS.items():  # "GB200" before "B200", "H200" before "H20"
        if model in device_name.upper():
            return tflops * 1e12
    return None


@dataclass(frozen=True)
class MatmulShape:
    """The sizes of a decoder that set its FLOPs per token."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int
    """Per token: the dense MLP's intermediate size, or the routed experts' (x ``num_experts_per_tok``)
    plus a shared expert's."""
    vocab: int
    experts: int = 0
    """Routed experts (0: dense): each token's router scores all of them."""
    window: int = 0
    """Sliding attention window of every layer, in tokens (0: none)."""

    @classmethod
    def from_hf_config(cls, config) -> MatmulShape:
        """From a ``transformers`` config (dense or MoE, every layer alike)."""
        heads = config.num_attention_heads
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
        if experts:
            routed = config.num_experts_per_tok * (
                getattr(config, "moe_intermediate_size", None) or config.intermediate_size
            )
            mlp_width = routed + (getattr(config, "shared_expert_intermediate_size", None) or 0)
        else:
            mlp_width = config.intermediate_size
        return cls(
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            mlp_width=mlp_width,
            vocab=config.vocab_size,
            experts=experts,
            window=sliding_window(config) or 0,
        )

    @property
    def matmul_params(self) -> int:
        """Parameters a token passes through in matmuls (the LM head included)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # Q and O, K and V
        mlp = 3 * self.hidden * self.mlp_width + self.hidden * self.experts  # gate, up, down; the router
        return self.layers * (attention + mlp) + self.vocab * self.hidden


def train_flops(shape: MatmulShape, seq_lens: Iterable[int], convention: str = "causal") -> float:
    """Model FLOPs of one forward and backward over sequences of ``seq_lens`` tokens."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention {convention!r}: expected one of {', '.join(CONVENTIONS)}")
    lens = [int(n) for n in seq_lens]
    per_score = 6 if convention == "causal" else 12  # x L d S^2 for a sequence of S tokens
    w = shape.window if convention == "causal" else 0
    scores = sum(n * n if not w or n <= w else 2 * n * w - w * w for n in lens)  # 2x the visible pairs
    attention = per_score * shape.layers * shape.heads * shape.head_dim * scores
    return 6 * shape.matmul_params * sum(lens) + attention
