"""The allocation-mode grammar: parsing, world sizes, and validation against cluster and model."""

import pytest

from megarl.config.allocation import (
    AllocationError,
    AllocationMode,
    ModelShape,
    validate_allocation,
    validate_model,
)

# (string, inference (backend, dp, tp, pp) or None, training (dp, pp, tp, ep, etp, vpp, cp) or None, devices)
VALID = [
    ("vllm:d4t2+megatron:d2p2t2e2", ("vllm", 4, 2, 1), (2, 2, 2, 2, 2, 1, 1), 16),
    ("vllm:d1t1+megatron:d1p1t1", ("vllm", 1, 1, 1), (1, 1, 1, 1, 1, 1, 1), 2),
    ("sglang:d2t4+megatron:d4p1t2", ("sglang", 2, 4, 1), (4, 1, 2, 1, 2, 1, 1), 16),
    ("vllm:d48t2+megatron:d4p2t4", ("vllm", 48, 2, 1), (4, 2, 4, 1, 4, 1, 1), 128),
    ("megatron:d2p2t2", None, (2, 2, 2, 1, 2, 1, 1), 8),
    ("vllm:d8t1", ("vllm", 8, 1, 1), None, 8),
    ("vllm:t2d4+megatron:t2d2p2", ("vllm", 4, 2, 1), (2, 2, 2, 1, 2, 1, 1), 16),  # order-free
    ("megatron:d2p2t2+vllm:d4t2", ("vllm", 4, 2, 1), (2, 2, 2, 1, 2, 1, 1), 16),  # part order-free
    ("vllm:d2p2t2+megatron:d1p1t1", ("vllm", 2, 2, 2), (1, 1, 1, 1, 1, 1, 1), 9),
    ("vllm:d1t1+megatron:d4p1t1e2et1", ("vllm", 1, 1, 1), (4, 1, 1, 2, 1, 1, 1), 5),
    ("vllm:d1t1+megatron:d2p1t2e2et1", ("vllm", 1, 1, 1), (2, 1, 2, 2, 1, 1, 1), 5),
    ("vllm:d1t1+megatron:d1p4t1v2", ("vllm", 1, 1, 1), (1, 4, 1, 1, 1, 2, 1), 5),
    ("vllm:d1t1+megatron:d1p2t1c2", ("vllm", 1, 1, 1), (1, 2, 1, 1, 1, 1, 2), 5),
    ("megatron:d8", None, (8, 1, 1, 1, 1, 1, 1), 8),  # omitted sizes are 1
    ("  vllm:d1t1 + megatron:d1p1t1  ", ("vllm", 1, 1, 1), (1, 1, 1, 1, 1, 1, 1), 2),  # whitespace
    ("sglang:d16t8+megatron:d8p4t4e8et1", ("sglang", 16, 8, 1), (8, 4, 4, 8, 1, 1, 1), 256),
]


@pytest.mark.parametrize("spec,inference,train,devices", VALID, ids=[v[0].strip() for v in VALID])
def test_parse_valid(spec, inference, train, devices):
    alloc = AllocationMode.from_str(spec)
    if inference is None:
        assert alloc.inference is None
    else:
        inf = alloc.inference
        assert (inf.backend, inf.dp, inf.tp, inf.pp) == inference
    if train is None:
        assert alloc.train is None
    else:
        t = alloc.train
        assert (t.dp, t.pp, t.tp, t.ep, t.expert_tp, t.vpp, t.cp) == train
    assert alloc.world_size == devices


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("fsdp:d8", "unknown backend 'fsdp'"),
        ("vllm:d2t1+fsdp:d2", "'fsdp:d2'"),
        ("vllm", "no sizes"),
        ("vllm:", "no sizes"),
        ("vllm:d2x3", "unknown size 'x'3"),
        ("vllm:d2t1+megatron:d2q2", "unknown size 'q'2"),
        ("vllm:e2t1", "unknown size 'e'2; allowed here: d, t, p"),
        ("vllm:d0t1", "data parallel size d0 must be >= 1"),
        ("megatron:d1t0", "tensor parallel size t0"),
        ("vllm:d2d2", "size 'd' given twice"),
        ("vllm:d2t", "cannot read 'd2t'"),
        ("vllm:dd2", "cannot read 'dd2'"),
        ("vllm:D2T1", "cannot read 'D2T1'"),
        ("vllm:d2t1+sglang:d2t1", "more than one inference part"),
        ("megatron:d2+megatron:d2", "more than one training part"),
        ("vllm:d1t1+megatron:d1p1t1v2", "virtual pipeline v2 needs pipeline parallelism"),
        ("vllm:d1t1+megatron:d1p1t1e2", "e2 x expert tensor parallel et1 = 2 must divide"),
        ("vllm:d1t1+megatron:d1p1t2e2", "et2 = 4 must divide d1 x t2 x c1 = 2"),
        ("vllm:d2t2|megatron:d2t1", "both must use the same number: inference 'vllm:d2t2' uses 4, training"),
        ("vllm:d2x2|megatron:d2t2", "unknown size 'x'2"),  # syntax errors win over the colocated checks
        ("vllm:d1t1|megatron:d1t1+vllm:d1t1", "either '+' (separate devices) or '|' (shared), not both"),
        ("vllm:d2t1|", "part ''"),
        ("vllm:d2t1|vllm:d2t1", "more than one inference part"),
        ("megatron:d2|megatron:d2", "more than one training part"),
        ("vllm:d2t2+", "part ''"),
        ("vllm:d2t-1", "cannot read 'd2t-1'"),
    ],
)
def test_parse_invalid_names_offending_part(spec, needle):
    with pytest.raises(AllocationError) as err:
        AllocationMode.from_str(spec)
    assert needle in str(err.value)


def test_colocated_parts_share_devices():
    alloc = AllocationMode.from_str("vllm:d2t2|megatron:d2p1t2")
    assert alloc.colocated and alloc.world_size == 4 and str(alloc) == "vllm:d2t2|megatron:d2p1t2"
    assert not AllocationMode.from_str("vllm:d2t2+megatron:d2p1t2").colocated
    validate_allocation(alloc, n_nodes=1, n_gpus_per_node=4)
    with pytest.raises(AllocationError, match=r"uses 4 \(shared by 'vllm:d2t2' and 'megatron:d2p1t2'\) devices"):
        validate_allocation(alloc, n_nodes=1, n_gpus_per_node=8)


def test_roundtrip_str():
    for spec in [
        "vllm:d4t2+megatron:d2p2t2e2",
        "sglang:d2p2t2+megatron:d4p2t1et1v2c2",
        "megatron:d1p1t1",
        "vllm:d8t2|megatron:d4p2t2",
    ]:
        alloc = AllocationMode.from_str(spec)
        assert AllocationMode.from_str(str(alloc)) == alloc


def test_expert_data_parallel_size():
    train = AllocationMode.from_str("megatron:d4p2t2e4et1").train
    assert train.world_size == 16
    assert train.edp == 4 * 2 // (4 * 1)


@pytest.mark.parametrize(
    "spec,nodes,per_node,needle",
    [
        (
            "vllm:d2t1+megatron:d1p1t1",
            1,
            2,
            "uses 2 (vllm:d2t1) + 1 (megatron:d1p1t1) = 3 devices, but the cluster has 1 nodes x 2",
        ),
        ("vllm:d4t2+megatron:d2p2t2", 1, 8, "= 16 devices, but the cluster has 1 nodes x 8 GPUs per node = 8"),
        ("vllm:d1t16+megatron:d16p1t1", 4, 8, "needs t16 x p1 = 16 devices, more than the 8 GPUs of one node"),
        ("vllm:d3t2+megatron:d5p1t2", 2, 8, "inference part 'vllm:d3t2' uses 6 devices, not a multiple of 8"),
    ],
)
def test_cluster_mismatch(spec, nodes, per_node, needle):
    with pytest.raises(AllocationError) as err:
        validate_allocation(AllocationMode.from_str(spec), n_nodes=nodes, n_gpus_per_node=per_node)
    assert needle in str(err.value)


def test_cluster_fits():
    validate_allocation(AllocationMode.from_str("vllm:d48t2+megatron:d4p2t4"), n_nodes=16, n_gpus_per_node=8)
    validate_allocation(AllocationMode.from_str("vllm:d3t2+megatron:d1p1t2"), n_nodes=1, n_gpus_per_node=8)


SMOLLM2 = ModelShape(num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
MOE = ModelShape(num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=24, num_experts=60)


@pytest.mark.parametrize(
    "spec,model,needle",
    [
        (
            "vllm:d1t1+megatron:d1p1t2",
            SMOLLM2,
            "megatron tensor parallel t2 does not divide the model's 9 attention heads",
        ),
        ("vllm:d1t2+megatron:d1p1t1", SMOLLM2, "vllm tensor parallel t2 does not divide the model's 9 attention heads"),
        ("vllm:d1t1+megatron:d1p4t1", SMOLLM2, "pipeline p4 x virtual v1 = 4 does not divide the model's 30 layers"),
        ("vllm:d1t1+megatron:d1p2t1v2", SMOLLM2, "= 4 does not divide the model's 30 layers"),
        ("vllm:d1t1+megatron:d2p1t1e2", SMOLLM2, "expert parallel e2 is set, but the model has no experts"),
        ("vllm:d1t1+megatron:d8p1t1e8", MOE, "expert parallel e8 does not divide the model's 60 experts"),
        ("vllm:d1t1+megatron:d1p1t8", MOE, "t8 does not divide the model's 4 key/value heads"),
    ],
)
def test_model_mismatch(spec, model, needle):
    with pytest.raises(AllocationError) as err:
        validate_model(AllocationMode.from_str(spec), model)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "spec,model",
    [
        ("vllm:d1t3+megatron:d1p1t3", SMOLLM2),
        ("vllm:d1t1+megatron:d1p2t1v3", SMOLLM2),
        ("vllm:d2t4+megatron:d4p2t4e4et1", MOE),
    ],
)
def test_model_fits(spec, model):
    validate_model(AllocationMode.from_str(spec), model)


def test_model_shape_from_hf_config_dict_and_object():
    shape = ModelShape.from_hf_config(
        {"num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 24, "num_experts": 60}
    )
    assert shape == MOE

    class Mixtral:  # transformers config objects expose attributes
        num_attention_heads, num_key_value_heads, num_hidden_layers, num_local_experts = 32, 8, 32, 8

    assert ModelShape.from_hf_config(Mixtral()).num_experts == 8
    llama = ModelShape.from_hf_config({"num_attention_heads": 9, "num_hidden_layers": 30})
    assert llama.num_key_value_heads == 9 and llama.num_experts == 0


@pytest.mark.parametrize("spec", ["vllm:d1t1+megatron:d1p1t1c2", "megatron:d2p2t2c4", "vllm:d2t1|megatron:d1p1t1c2"])
def test_context_parallel_is_a_layout_like_the_others(spec):
    alloc = AllocationMode.from_str(spec)
    validate_allocation(alloc)
    assert alloc.train.world_size == alloc.train.dp * alloc.train.pp * alloc.train.tp * alloc.train.cp
    assert alloc.train.dense_replicas == alloc.train.dp * alloc.train.cp
