"""The declarative HF <-> Megatron mapping: split rules, family tables, and a cross-check against mbridge."""

from __future__ import annotations

import pytest
import torch

from megarl.models.families import MODEL_FAMILIES, family_of
from megarl.models.mapping import (
    ModelDims,
    ParamRule,
    expert_placement,
    export_from_shards,
    load_shard,
)
from megarl.models.spec import canonical_name


def _reader(tensors: dict[str, torch.Tensor]):
    def read(name, dim, start, stop):
        t = tensors[name]
        return t if dim is None else t.narrow(dim, start, stop - start)

    return read


def _dims(heads=4, groups=2, head_dim=3, vocab=10, tp=1):
    return ModelDims(heads, groups, head_dim, vocab, -(-vocab // tp) * tp)


def _roundtrip(rule, tensors, dims, tp):
    names = rule.hf
    shards = [load_shard(rule, names, _reader(tensors), tuple(tensors[names[0]].shape), r, tp, dims) for r in range(tp)]
    return shards, export_from_shards(rule, names, shards, dims)


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_merges_gqa_groups_in_megatron_order(tp):
    dims = _dims(heads=4, groups=2, head_dim=3)
    hidden = 5
    q = torch.arange(12 * hidden, dtype=torch.float32).reshape(12, hidden)
    k = 1000 + torch.arange(6 * hidden, dtype=torch.float32).reshape(6, hidden)
    v = 2000 + torch.arange(6 * hidden, dtype=torch.float32).reshape(6, hidden)
    rule = ParamRule("qkv", ("q", "k", "v"), "qkv")
    shards, back = _roundtrip(rule, {"q": q, "k": k, "v": v}, dims, tp)
    # per KV group g: its 2 query heads (rows 6g..6g+5), then k rows 3g..3g+2, then v rows 3g..3g+2
    expected = torch.cat(
        [torch.cat([q[6 * g : 6 * g + 6], k[3 * g : 3 * g + 3], v[3 * g : 3 * g + 3]]) for g in range(2)]
    )
    assert torch.equal(torch.cat(shards), expected)
    assert all(s.shape[0] == expected.shape[0] // tp for s in shards)
    assert torch.equal(back["q"], q) and torch.equal(back["k"], k) and torch.equal(back["v"], v)


def test_qkv_bias_roundtrip_over_tp():
    dims = _dims(heads=6, groups=3, head_dim=2)
    tensors = {"q": torch.randn(12), "k": torch.randn(6), "v": torch.randn(6)}
    rule = ParamRule("b", ("q", "k", "v"), "qkv")
    shards, back = _roundtrip(rule, tensors, dims, 3)
    assert [s.shape[0] for s in shards] == [8, 8, 8]
    assert all(torch.equal(back[n], tensors[n]) for n in tensors)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_each_rank_holds_its_gate_then_its_up(tp):
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    shards, back = _roundtrip(ParamRule("fc1", ("g", "u"), "gate_up"), {"g": gate, "u": up}, _dims(), tp)
    step = 8 // tp
    for r, shard in enumerate(shards):
        assert torch.equal(shard, torch.cat([gate[r * step : (r + 1) * step], up[r * step : (r + 1) * step]]))
    assert torch.equal(back["g"], gate) and torch.equal(back["u"], up)


@pytest.mark.parametrize("split,dim", [("column", 0), ("row", 1)])
def test_column_and_row_splits(split, dim):
    w = torch.randn(6, 4)
    shards, back = _roundtrip(ParamRule("w", ("w",), split), {"w": w}, _dims(), 2)
    assert [tuple(s.shape) for s in shards] == [tuple(c.shape) for c in w.chunk(2, dim=dim)]
    assert torch.equal(back["w"], w)


def test_vocab_padding_adds_zero_rows_and_export_drops_them():
    dims = _dims(vocab=7, tp=2)  # padded to 8
    emb = torch.randn(7, 3)
    shards, back = _roundtrip(ParamRule("e", ("e",), "vocab"), {"e": emb}, dims, 2)
    assert [s.shape[0] for s in shards] == [4, 4]
    assert torch.equal(shards[1][-1], torch.zeros(3))
    assert torch.equal(back["e"], emb)


def test_replicated_is_whole_on_every_rank():
    w = torch.randn(5)
    shards, back = _roundtrip(ParamRule("n", ("n",), "replicated"), {"n": w}, _dims(), 3)
    assert all(torch.equal(s, w) for s in shards) and torch.equal(back["n"], w)


def test_bad_rules_and_splits_raise_value_error():
    with pytest.raises(ValueError, match="split 'diagonal'"):
        ParamRule("x", ("a",), "diagonal")
    with pytest.raises(ValueError, match="takes 3 HF names"):
        ParamRule("x", ("a", "b"), "qkv")
    with pytest.raises(ValueError, match="does not split over 4"):
        _roundtrip(ParamRule("w", ("w",), "column"), {"w": torch.randn(6, 2)}, _dims(), 4)
    with pytest.raises(ValueError, match="do not split over expert parallel size 3"):
        expert_placement(0, 4, 3)


def test_expert_placement_is_contiguous():
    assert [expert_placement(e, 8, 2) for e in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]


def test_family_mapping_matches_global_layer_and_expert():
    mapping = MODEL_FAMILIES["qwen3_moe"].mapping(tie_word_embeddings=False)
    rule, fields = mapping.match("decoder.layers.12.mlp.experts.local_experts.5.linear_fc1.weight")
    assert rule.split == "gate_up" and rule.is_expert and fields == {"layer": 12, "expert": 5}
    assert rule.hf_names(**fields) == (
        "model.layers.12.mlp.experts.5.gate_proj.weight",
        "model.layers.12.mlp.experts.5.up_proj.weight",
    )
    with pytest.raises(KeyError, match="no HF mapping"):
        mapping.match("decoder.layers.0.mlp.linear_fc1.weight")


def test_tied_embeddings_load_output_layer_from_embedding_and_skip_it_on_export():
    rule, _ = MODEL_FAMILIES["llama"].mapping(tie_word_embeddings=True).match("output_layer.weight")
    assert rule.hf == ("model.embed_tokens.weight",) and not rule.export


def test_canonical_name_folds_transformer_engine_norms():
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == (
        "decoder.layers.3.input_layernorm.weight"
    )
    assert (
        canonical_name("decoder.layers.3.mlp.linear_fc1.layer_norm_weight")
        == "decoder.layers.3.pre_mlp_layernorm.weight"
    )
    assert canonical_name("decoder.layers.3.mlp.linear_fc1.weight") == "decoder.layers.3.mlp.linear_fc1.weight"


def test_family_of_rejects_unknown_model_type():
    class Cfg:
        model_type = "gpt2"

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        family_of(Cfg())


def test_the_model_tables_old_name_warns_until_0_2_0():
    import megarl.models.families as families

    with pytest.warns(DeprecationWarning, match="MODEL_FAMILIES .*0.2.0"):
        assert families.FAMILIES is MODEL_FAMILIES


def test_checkpoint_tensors_no_rule_loads_are_named():
    """An o_proj bias (Llama's attention_bias) has no rule; RoPE's cached frequencies and a tied model's
    own lm_head copy are not weights megarl should hold."""
    mapping = MODEL_FAMILIES["llama"].mapping(tie_word_embeddings=True)
    names = [
        "model.embed_tokens.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.o_proj.bias",
        "model.layers.3.self_attn.rotary_emb.inv_freq",
        "lm_head.weight",
        "model.norm.weight",
    ]
    assert mapping.hf_names_not_loaded(names, tied=True) == ["model.layers.3.self_attn.o_proj.bias"]
    untied = MODEL_FAMILIES["llama"].mapping(tie_word_embeddings=False)
    assert untied.hf_names_not_loaded(names, tied=False) == ["model.layers.3.self_attn.o_proj.bias"]


def test_loading_a_checkpoint_with_tensors_megarl_has_no_place_for_fails_naming_them(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from megarl.models.build import describe
    from megarl.models.hf_io import ShardCoords, load_hf_weights

    source = tiny_model_dir("llama")
    shutil.copytree(source, tmp_path / "m")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.bias"] = torch.zeros(128)
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"1 tensor\(s\) that megarl's llama layers have no place for \(model.layers.0.mlp"
    ):
        load_hf_weights([], describe(source), tmp_path / "m", ShardCoords())
