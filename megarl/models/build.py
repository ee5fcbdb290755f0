"""HF config → Megatron ``TransformerConfig`` and ``GPTModel`` chunks for this rank.

:func:`describe` reads an HF config (directory or object) into a :class:`ModelDesc`
(family, sizes, the weight mapping); :func:`transformer_config` turns it plus the
parallel layout into a ``TransformerConfig``; :func:`build_chunks` builds this
rank's model chunks (one per virtual pipeline stage) with the family's layer spec.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel

from megarl.models.families import Family, check_layers_hold, family_of, sliding_window
from megarl.models.mapping import FamilyMapping, ModelDims
from megarl.models.spec import block_spec

logger = logging.getLogger(__name__)


class ParallelSizes(Protocol):
    """The parallel sizes a build reads (``megarl.config.allocation.TrainingAllocation`` has them)."""

    tp: int
    pp: int
    vpp: int
    ep: int
    expert_tp: int
    cp: int


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelDesc:
    """What megarl needs to know about an HF model to build and (un)load it."""

    hf_config: object
    """The ``transformers`` config."""
    family: Family
    dims: ModelDims
    mapping: FamilyMapping
    tie_word_embeddings: bool


def load_hf_config(path: str | os.PathLike):
    """The ``transformers`` config of an HF directory."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def describe(hf_config, tp: int = 1) -> ModelDesc:
    """Family, sizes and mapping of ``hf_config`` with the vocabulary padded to a multiple of ``tp``."""
    if isinstance(hf_config, (str, os.PathLike)):
        hf_config = load_hf_config(hf_config)
    family = family_of(hf_config)
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    vocab = hf_config.vocab_size
    dims = ModelDims(heads, groups, head_dim, vocab, -(-vocab // tp) * tp)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    _check_supported(hf_config, family, tp)
    return ModelDesc(hf_config, family, dims, family.mapping(tie), tie)


def _check_supported(hf_config, family: Family, tp: int) -> None:
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp or groups % tp:
        raise ValueError(f"tensor parallel size {tp} must divide attention heads {heads} and KV heads {groups}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (SwiGLU families only)")
    rope = rope_parameters(hf_config)
    if rope.get("rope_type", "default") not in _ROPE_TYPES:
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported; supported: {_ROPE_TYPES}")
    if family.moe and (
        getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1
    ):
        raise ValueError(
            "MoE models whose layers are not all sparse (mlp_only_layers / decoder_sparse_step) are not supported"
        )
    check_layers_hold(hf_config)


def rope_parameters(hf_config) -> dict:
    """RoPE settings of an HF config, for transformers 4 (``rope_theta``/``rope_scaling``) and 5."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def rope_inv_freq(hf_config) -> torch.Tensor | None:
    """HF's inverse frequencies when they differ from plain ``theta``-RoPE (None otherwise)."""
    rope_type = rope_parameters(hf_config).get("rope_type", "default")
    if rope_type == "default":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    if attention_scaling != 1.0:
        raise ValueError(f"rope_type {rope_type!r} with attention scaling {attention_scaling} is not supported")
    return inv_freq


def transformer_config(
    desc: ModelDesc,
    alloc: ParallelSizes,
    *,
    sequence_parallel: bool = False,
    dtype: str = "bfloat16",
    moe_dispatcher: str = "alltoall",
    moe_aux_loss_coeff: float = 0.0,
    recompute: str = "none",
    use_cpu_initialization: bool = True,
    perform_initialization: bool = False,
):
    """Megatron's TransformerConfig for ``desc`` under ``alloc`` (dropout off: RL recomputes logprobs).

    ``sequence_parallel`` takes effect only with tensor parallelism (tp > 1). ``moe_aux_loss_coeff`` > 0
    adds Megatron's router load-balancing loss (``aux_loss``) with that weight; 0 leaves it off.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    hf = desc.hf_config
    params_dtype = DTYPES[dtype]
    kwargs = {
        "num_layers": hf.num_hidden_layers,
        "hidden_size": hf.hidden_size,
        "ffn_hidden_size": hf.intermediate_size,
        "num_attention_heads": desc.dims.num_attention_heads,
        "num_query_groups": desc.dims.num_query_groups,
        "kv_channels": desc.dims.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": desc.family.qkv_bias,
        "qk_layernorm": desc.family.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        "use_cpu_initialization": use_cpu_initialization,
        "perform_initialization": perform_initialization,
        "tensor_model_parallel_size": alloc.tp,
        "pipeline_model_parallel_size": alloc.pp,
        "virtual_pipeline_model_parallel_size": alloc.vpp if alloc.vpp > 1 else None,
        "expert_model_parallel_size": alloc.ep,
        "expert_tensor_parallel_size": alloc.expert_tp,
        "context_parallel_size": alloc.cp,
        "sequence_parallel": sequence_parallel and alloc.tp > 1,
    }
    kwargs.update(_window_kwargs(hf))
    if recompute != "none":
        kwargs.update(recompute_granularity=recompute)
        if recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    if desc.family.moe:
        kwargs.update(_moe_kwargs(hf, moe_dispatcher, moe_aux_loss_coeff))
    return TransformerConfig(**kwargs)


def _window_kwargs(hf) -> dict:
    """Megatron's sliding-window setting (TransformerEngine's and :class:`~megarl.models.layers.SDPACoreAttention`'s):
    ``window_size`` = (keys before each query, keys after it), on every layer."""
    window = sliding_window(hf)
    return {} if window is None else {"window_size": (window - 1, 0)}


def _moe_kwargs(hf, dispatcher: str, aux_loss_coeff: float) -> dict:
    num_experts = getattr(hf, "num_experts", None) or hf.num_local_experts
    return {
        "num_moe_experts": num_experts,
        "moe_ffn_hidden_size": getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size,
        "moe_router_topk": hf.num_experts_per_tok,
        # softmax over the top-k logits == renormalised top-k probabilities (norm_topk_prob)
        "moe_router_pre_softmax": not getattr(hf, "norm_topk_prob", True),
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss" if aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": aux_loss_coeff,
        "moe_token_dispatcher_type": dispatcher,
        "moe_grouped_gemm": False,
        "moe_router_dtype": "fp32",
    }


class HiddenStatesGPTModel(GPTModel):
    """A GPTModel whose last stage returns the final-norm hidden states ``[s, b, h]``.

    The LM head is applied by the loss (``megarl.actor.lm_head``) with a fused,
    vocab-parallel logprob kernel, so full logits are never materialised.
    ``return_hidden = False`` restores GPTModel's logits (tests, debugging).
    """

    return_hidden = True

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        """GPTModel's, except that ``position_ids`` (packed: ``[1, T]``) place RoPE per token.

        Megatron's RoPE ignores ``position_ids`` and numbers each packed sequence from 0;
        a branch of a shared prefix (``megarl.actor.packing``) starts where its prefix ends.
        A table with one row per packed token is what Megatron's THD RoPE applies as is.
        """
        out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        rotary = out[1]
        if position_ids is None or rotary is None:
            return out
        return (out[0], rotary[position_ids.reshape(-1)], *out[2:])

    def _postprocess(self, hidden_states, *args, **kwargs):
        if self.return_hidden or not self.post_process:
            return hidden_states
        return super()._postprocess(hidden_states, *args, **kwargs)


def build_chunks(desc: ModelDesc, config, *, use_te: bool = False) -> list:
    """This rank's model chunks (one per virtual pipeline stage), on CPU or the current GPU."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    vpp = config.virtual_pipeline_model_parallel_size or 1
    rope = rope_parameters(desc.hf_config)
    inv_freq = rope_inv_freq(desc.hf_config)
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        model = HiddenStatesGPTModel(
            config=config,
            transformer_layer_spec=block_spec(desc.family, use_te, get_num_layers_to_build(config, stage)),
            vocab_size=desc.dims.padded_vocab_size,
            max_sequence_length=desc.hf_config.max_position_embeddings,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=desc.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=rope["rope_theta"],
            vp_stage=stage,
        )
        if inv_freq is not None:
            model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq)
        _mark_tensor_parallel(model)
        chunks.append(model)
    return chunks


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Tag TP-split weights the way Megatron's initialisers would.

    With ``perform_initialization=False`` (weights come from the HF checkpoint) megatron-core
    0.16 skips the initialiser that sets ``tensor_model_parallel`` / ``partition_dim``;
    without them the grad-norm (and so clipping) counts split weights as TP duplicates.
    """
    from megatron.core import tensor_parallel as tpl

    dims = {tpl.ColumnParallelLinear: 0, tpl.RowParallelLinear: 1, tpl.VocabParallelEmbedding: 0}
    for module in model.modules():
        dim = next((d for cls, d in dims.items() if isinstance(module, cls)), None)
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not getattr(weight, "tensor_model_parallel", False):
            tpl.set_tensor_model_parallel_attributes(weight, True, dim, 1)
