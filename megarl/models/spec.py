"""Megatron layer specs for the supported families: TransformerEngine on GPU, local + SDPA otherwise.

Both specs produce the same parameter names up to the fused layer norms of the TE
linears; :func:`canonical_name` maps TE names onto the local names the family
mappings are written in, so the mapping stays one table per family.
"""

from __future__ import annotations

import copy
import logging

from megatron.core.transformer.spec_utils import ModuleSpec

from megarl.models.families import Family
from megarl.models.layers import RMSNorm, SDPACoreAttention

logger = logging.getLogger(__name__)

# TE fuses the pre-attention / pre-MLP norms into the following linear (dense layers only).
_TE_TO_LOCAL = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
)


def transformer_engine_available() -> bool:
    """Whether TransformerEngine imports (never on CPU-only installs)."""
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # absent, or a CUDA-less TE failing at import
        return False
    return True


def resolve_use_te(requested: bool | None, on_gpu: bool) -> bool:
    """TE when requested (ValueError if absent), else auto: TE iff installed and on GPU."""
    available = on_gpu and transformer_engine_available()
    if requested and not available:
        raise ValueError(
            "use_transformer_engine=True, but TransformerEngine is not usable here (no GPU, or not "
            "installed: pip install 'megarl[te]')"
        )
    return available if requested is None else requested


def layer_spec(family: Family, use_te: bool) -> ModuleSpec:
    """The transformer-layer spec of ``family`` (experts as a SequentialMLP, named per expert)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    num_experts = 1 if family.moe else None  # only the MLP kind matters to the spec
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=family.qk_norm
        )
    spec = copy.deepcopy(
        specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=family.qk_norm, normalization="RMSNorm"
        )
    )
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    attn = sub.self_attention.submodules
    attn.core_attention = SDPACoreAttention
    if family.qk_norm:
        attn.q_layernorm = RMSNorm
        attn.k_layernorm = RMSNorm
    return spec


def block_spec(family: Family, use_te: bool, num_layers: int):
    """A TransformerBlock spec: ``num_layers`` layers of :func:`layer_spec` and the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer_spec(family, use_te)] * num_layers, layer_norm=final_norm)


def canonical_name(name: str) -> str:
    """Map a TE-spec parameter name onto the local-spec name the mappings use."""
    for te_suffix, local_suffix in _TE_TO_LOCAL:
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name
