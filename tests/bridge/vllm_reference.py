"""vLLM's own parallel layers as the reference for what an inference worker holds.

The layers are built in-process with vLLM's tensor-parallel rank / size patched in (no
process groups), and loaded with their own ``weight_loader`` from full HF tensors: the
result is exactly the local shard a vLLM worker would hold. FusedMoE needs a whole vLLM
MoE runtime to construct, so expert slices are checked against its loader's documented
layout instead (``w13[e] = [gate chunk; up chunk]``, ``w2[e]`` chunked along dim 1).
"""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

import torch


@contextlib.contextmanager
def vllm_tp(size: int, rank: int):
    """vLLM layers built inside see tensor-parallel ``rank`` of ``size``."""
    import vllm.model_executor.layers.linear
    import vllm.model_executor.layers.vocab_parallel_embedding  # noqa: F401
    from vllm.config import VllmConfig, set_current_vllm_config

    values = {"get_tensor_model_parallel_world_size": size, "get_tensor_model_parallel_rank": rank}
    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if not name.startswith("vllm.") or module is None:
                continue
            for fn, value in values.items():
                if hasattr(module, fn):
                    stack.enter_context(mock.patch.object(module, fn, return_value=value))
        stack.enter_context(set_current_vllm_config(VllmConfig()))
        yield


def reference_local(
    name: str, expert: int | None, hf: dict[str, torch.Tensor], dims, size: int, rank: int
) -> torch.Tensor:
    """The local tensor ``name`` (``expert``) of vLLM worker ``rank`` of ``size``, loaded by vLLM."""
    from vllm.model_executor.layers import linear as L
    from vllm.model_executor.layers import vocab_parallel_embedding as VE

    prefix, _, leaf = name.rpartition(".")
    with vllm_tp(size, rank):
        if prefix.endswith("qkv_proj"):
            base = prefix[: -len("qkv_proj")]
            q = hf[f"{base}q_proj.weight"]
            layer = L.QKVParallelLinear(
                q.shape[1],
                dims.head_dim,
                dims.num_attention_heads,
                dims.num_query_groups,
                bias=leaf == "bias",
                params_dtype=q.dtype,
            )
            param = getattr(layer, leaf)
            for shard in "qkv":
                layer.weight_loader(param, hf[f"{base}{shard}_proj.{leaf}"], shard)
            return param.data
        if prefix.endswith("gate_up_proj"):
            base = prefix[: -len("gate_up_proj")]
            gate, up = hf[f"{base}gate_proj.weight"], hf[f"{base}up_proj.weight"]
            layer = L.MergedColumnParallelLinear(
                gate.shape[1], [gate.shape[0]] * 2, bias=False, params_dtype=gate.dtype
            )
            layer.weight_loader(layer.weight, gate, 0)
            layer.weight_loader(layer.weight, up, 1)
            return layer.weight.data
        if prefix.endswith(("o_proj", "down_proj")) and expert is None:
            w = hf[name]
            layer = L.RowParallelLinear(w.shape[1], w.shape[0], bias=False, params_dtype=w.dtype)
            layer.weight_loader(layer.weight, w)
            return layer.weight.data
        if prefix.endswith(("embed_tokens", "lm_head")):
            w = hf[name]
            cls = VE.VocabParallelEmbedding if prefix.endswith("embed_tokens") else VE.ParallelLMHead
            layer = cls(w.shape[0], w.shape[1], params_dtype=w.dtype)
            layer.weight_loader(layer.weight, w)
            return layer.weight.data
    if expert is not None:
        return _expert_reference(name, expert, hf, size, rank)
    return hf[name]


def _expert_reference(name: str, expert: int, hf, size: int, rank: int) -> torch.Tensor:
    base = name.rpartition(".experts.")[0] + f".experts.{expert}."
    if name.endswith("w13_weight"):
        gate, up = hf[f"{base}gate_proj.weight"], hf[f"{base}up_proj.weight"]
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])
    return hf[f"{base}down_proj.weight"].chunk(size, 1)[rank]
