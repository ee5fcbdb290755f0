"""Supported model families: one declarative entry per family (HF names, features, mapping).

A :class:`Family` names the HF architecture(s), the features its layer spec needs
(QKV bias, QK norm, MoE) and produces the family's :class:`~megarl.models.mapping.ParamRule`
table for a given HF config. Adding a Llama-like family is one more entry in
:data:`MODEL_FAMILIES`; everything downstream (model build, HF load / export, the weight
bridge) reads this table.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models.mapping import FamilyMapping, ParamRule
from megarl.utils.deprecation import renamed_in

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."


@dataclass(frozen=True)
class Family:
    """A Llama-like decoder family and how its HF checkpoint maps onto Megatron's GPTModel."""

    name: str
    """Short name (the HF ``model_type``)."""
    architectures: tuple[str, ...]
    """HF ``architectures`` entries this family accepts."""
    qkv_bias: bool = False
    """Attention q/k/v projections carry biases (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys (Qwen3)."""
    moe: bool = False
    """Every layer's MLP is a routed mixture of experts (Qwen3-MoE, Mixtral)."""
    hf_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """HF module names of one expert's gate, up and down projections."""
    hf_router: str = "mlp.gate"
    """HF module name of the router."""
    hf_experts: str = "mlp.experts"
    """HF module name of the expert list."""

    def mapping(self, tie_word_embeddings: bool) -> FamilyMapping:
        """The family's rules; with tied embeddings the output layer loads the embedding."""
        rules = [ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
        rules += self._attention_rules()
        rules += self._moe_rules() if self.moe else self._mlp_rules()
        rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        if tie_word_embeddings:
            # Megatron keeps a copy on the last stage when PP > 1 (embedding group keeps it in sync).
            rules.append(ParamRule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", export=False))
        else:
            rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "vocab"))
        return FamilyMapping(tuple(rules))

    def _attention_rules(self) -> list[ParamRule]:
        qkv = tuple(f"{_H}self_attn.{p}_proj.weight" for p in "qkv")
        rules = [
            ParamRule(f"{_L}input_layernorm.weight", (f"{_H}input_layernorm.weight",), "replicated"),
            ParamRule(f"{_L}self_attention.linear_qkv.weight", qkv, "qkv"),
            ParamRule(f"{_L}self_attention.linear_proj.weight", (f"{_H}self_attn.o_proj.weight",), "row"),
            ParamRule(f"{_L}pre_mlp_layernorm.weight", (f"{_H}post_attention_layernorm.weight",), "replicated"),
        ]
        if self.qkv_bias:
            bias = tuple(f"{_H}self_attn.{p}_proj.bias" for p in "qkv")
            rules.append(ParamRule(f"{_L}self_attention.linear_qkv.bias", bias, "qkv"))
        if self.qk_norm:
            rules += [
                ParamRule(f"{_L}self_attention.q_layernorm.weight", (f"{_H}self_attn.q_norm.weight",), "replicated"),
                ParamRule(f"{_L}self_attention.k_layernorm.weight", (f"{_H}self_attn.k_norm.weight",), "replicated"),
            ]
        return rules

    def _mlp_rules(self) -> list[ParamRule]:
        gate_up = (f"{_H}mlp.gate_proj.weight", f"{_H}mlp.up_proj.weight")
        return [
            ParamRule(f"{_L}mlp.linear_fc1.weight", gate_up, "gate_up"),
            ParamRule(f"{_L}mlp.linear_fc2.weight", (f"{_H}mlp.down_proj.weight",), "row"),
        ]

    def _moe_rules(self) -> list[ParamRule]:
        gate, up, down = (f"{_H}{self.hf_experts}.{{expert}}.{n}.weight" for n in self.hf_expert_names)
        expert = f"{_L}mlp.experts.local_experts.{{expert}}."
        return [
            ParamRule(f"{_L}mlp.router.weight", (f"{_H}{self.hf_router}.weight",), "replicated"),
            ParamRule(f"{expert}linear_fc1.weight", (gate, up), "gate_up"),
            ParamRule(f"{expert}linear_fc2.weight", (down,), "row"),
        ]


MODEL_FAMILIES: dict[str, Family] = {
    "llama": Family("llama", ("LlamaForCausalLM",)),
    "mistral": Family("mistral", ("MistralForCausalLM",)),
    "qwen2": Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True),
    "qwen3": Family("qwen3", ("Qwen3ForCausalLM",), qk_norm=True),
    "qwen3_moe": Family("qwen3_moe", ("Qwen3MoeForCausalLM",), qk_norm=True, moe=True),
    "mixtral": Family(
        "mixtral",
        ("MixtralForCausalLM",),
        moe=True,
        hf_expert_names=("w1", "w3", "w2"),
        hf_router="block_sparse_moe.gate",
        hf_experts="block_sparse_moe.experts",
    ),
}


def family_of(hf_config) -> Family:
    """The :class:`Family` of an HF config (by ``model_type``); ValueError names unsupported ones."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[model_type]


def sliding_window(hf_config) -> int | None:
    """The sliding attention window of an HF config, in tokens (a query sees itself and the ``window - 1``
    tokens before it, HF's and vLLM's rule), on every layer; None when there is none.

    Mistral's and Mixtral's ``sliding_window``. Refused, naming the key: Qwen2's and Qwen3's
    ``use_sliding_window: true`` (a window on the layers from ``max_window_layers`` on, which vLLM does not
    serve; no released Qwen2 or Qwen3 checkpoint turns it on), ``layer_types`` that mix sliding and full
    layers, and a window that is not a positive number of tokens."""
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            "use_sliding_window: true is not supported: its window covers only the layers from "
            "max_window_layers on, which vLLM does not serve"
        )
    size = getattr(hf_config, "sliding_window", None)
    if size is None or hasattr(hf_config, "use_sliding_window"):  # Qwen2 / Qwen3 keep the key unused
        return None
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"sliding_window {size!r} must be a positive number of tokens or null")
    kinds = set(getattr(hf_config, "layer_types", None) or ["sliding_attention"])
    if kinds != {"sliding_attention"}:
        raise ValueError(f"layer_types {sorted(kinds)}: a sliding window on some layers only is not supported")
    return size


def check_layers_hold(hf_config) -> None:
    """ValueError naming the key when an HF config (or its ``config.json`` as attributes) asks for what
    megarl's layers do not hold: projection biases (``attention_bias``, ``mlp_bias``) or a sliding window
    other than every layer's (:func:`sliding_window`). Run before launch and again at model build."""
    for key, what in (("attention_bias", "q/k/v/o projection biases"), ("mlp_bias", "MLP projection biases")):
        if getattr(hf_config, key, False):  # the mappings would leave these tensors in the checkpoint
            raise ValueError(f"{key}: true ({what}) is not supported: megarl's layers have no such biases")
    sliding_window(hf_config)


# ``FAMILIES``, the table's name before 0.1.0 (the add-a-model-family guide named it)
__getattr__ = renamed_in(__name__, {"FAMILIES": "MODEL_FAMILIES"}, globals())
