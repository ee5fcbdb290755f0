"""Cross-check megarl's HF <-> Megatron mapping against mbridge (an independent implementation).

For every parameter of tiny Llama and Qwen2 models and TP 1 / 2: mbridge's HF names for the
Megatron name, its merged-and-split Megatron shards and its TP merge + HF export must equal
ours. mbridge names the fused TE norms (``linear_qkv.layer_norm_weight``); megarl's canonical
names are the local-spec ones, folded by ``canonical_name``.
"""

from __future__ import annotations

import pytest
import torch

mbridge = pytest.importorskip("mbridge")

from megarl.models.build import describe
from megarl.models.hf_io import SafetensorsReader
from megarl.models.mapping import export_from_shards, load_shard

_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_PARTITION_DIM = {"column": 0, "vocab": 0, "row": 1}


def _te_name(name: str) -> str:
    for local, te in _LOCAL_TO_TE.items():
        if name.endswith(local):
            return name[: -len(local)] + te
    return name


def _canonical_names(desc) -> list[tuple[str, object, dict]]:
    out = []
    for rule in desc.mapping.rules:
        if "{layer}" in rule.megatron:
            out += [
                (rule.megatron.format(layer=i), rule, {"layer": i}) for i in range(desc.hf_config.num_hidden_layers)
            ]
        else:
            out.append((rule.megatron, rule, {}))
    return out


def _fake_param(shape, split):
    param = torch.empty(shape)
    if split in _PARTITION_DIM:
        param.tensor_model_parallel = True
        param.partition_dim = _PARTITION_DIM[split]
    return param


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_mapping_agrees_with_mbridge(tiny_model_dir, family, tp):
    from mbridge import AutoBridge
    from mbridge.core.parallel_states import ParallelStates

    model_dir = tiny_model_dir(family)
    bridge = AutoBridge.from_pretrained(str(model_dir), parallel_states=ParallelStates(tp_size=tp), dtype=torch.float32)
    desc = describe(model_dir, tp)
    reader = SafetensorsReader(model_dir)
    assert desc.dims.padded_vocab_size == desc.dims.vocab_size  # mbridge pads only when asked to
    covered = set()
    for name, rule, fields in _canonical_names(desc):
        te = _te_name(name)
        names = rule.hf_names(**fields)
        assert tuple(bridge._weight_name_mapping_mcore_to_hf(te)) == names, name
        covered.update(names)
        ours = [load_shard(rule, names, reader, reader.shape(names[0]), r, tp, desc.dims) for r in range(tp)]
        full = bridge._weight_to_mcore_format(te, [reader(n, None, 0, 0) for n in names])
        param = _fake_param(ours[0].shape, rule.split)
        theirs = bridge._weight_split_across_tp(te, full, param, tp)
        assert len(theirs) == tp and all(torch.equal(a, b) for a, b in zip(ours, theirs)), name
        if rule.split != "replicated":
            merged = bridge._weight_merge_across_tp(te, list(ours), param)
            hf_names, hf_tensors = bridge._weight_to_hf_format(te, merged)
            exported = export_from_shards(rule, names, ours, desc.dims)
            assert tuple(hf_names) == names
            assert all(torch.equal(exported[n], t) for n, t in zip(hf_names, hf_tensors)), name
    assert covered == set(reader.keys())  # every HF tensor is mapped
