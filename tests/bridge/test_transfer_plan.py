"""The transfer plan, checked against independent references (no processes).

* Reassembling every worker's sharded-mode pieces from the trainer's shards (built by the
  family mapping from the HF checkpoint) gives exactly what vLLM's own parallel layers
  load for that worker (``vllm_reference``), for many trainer and server layouts.
* Every exported HF tensor is sent exactly once in broadcast mode, by the stage that
  Megatron places its layer on.
* Bytes per worker in sharded mode are the model's bytes / server TP (plus replicated norms).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megarl.bridge.transfer_plan import build_plan
from megarl.config.allocation import TrainingAllocation
from megarl.models.build import describe
from megarl.models.hf_io import SafetensorsReader
from megarl.models.mapping import load_shard
from tests.bridge.vllm_reference import reference_local

FAMILY_LAYOUTS = {
    "llama": [TrainingAllocation(), TrainingAllocation(tp=2, pp=2), TrainingAllocation(tp=2, pp=2, vpp=2, dp=2)],
    "qwen2": [TrainingAllocation(tp=2), TrainingAllocation(pp=4, dp=2)],
    "qwen3": [TrainingAllocation(tp=2, pp=2, dp=2)],
    "qwen3_moe": [
        TrainingAllocation(tp=2, ep=2, etp=1),
        TrainingAllocation(tp=2, pp=2, ep=2, etp=1, dp=2),
        TrainingAllocation(tp=2, ep=1, etp=2),
    ],
}


def _random_layouts(seed: int, n: int, moe: bool) -> list[TrainingAllocation]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        tp, pp, vpp, dp = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([1, 2]), rng.choice([1, 2, 3])
        ep, etp = (rng.choice([1, 2, 4]), rng.choice([1, 2])) if moe else (1, tp)
        if pp * vpp > 4 or (dp * tp) % (ep * etp):
            continue
        out.append(TrainingAllocation(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, dp=dp))
    return out


@pytest.fixture(scope="module")
def model(tiny_model_dir, request):
    """(desc, reader, HF tensors) of a tiny model whose vocabulary needs padding on both sides."""
    family = request.param
    path = tiny_model_dir(family, vocab_size=1001)
    reader = SafetensorsReader(path)
    hf = {name: reader(name, None, 0, 0) for name in reader.keys()}  # noqa: SIM118 (the reader is not iterable)
    return family, path, reader, hf


def _trainer_shards(plan, desc, reader) -> dict[tuple[str, int], torch.Tensor]:
    shards = {}
    for src in plan.sources:
        size = plan.trainer.expert_tp if src.rule.is_expert else plan.trainer.tp
        for t in range(size):
            shape = reader.shape(src.hf_names[0])
            shards[src.megatron, t] = load_shard(src.rule, src.hf_names, reader, shape, t, size, desc.dims)
    return shards


def _assemble(plan, worker: int, shards) -> dict:
    """Each local tensor of ``worker`` rebuilt from the pieces, and a per-row coverage count."""
    out, cover = {}, {}
    for local in plan.local[worker]:
        key = (local.name, local.expert)
        out[key] = torch.zeros(local.shape)
        cover[key] = torch.zeros(local.shape[local.dim] if local.dim is not None else 1, dtype=torch.int64)
    for p in plan.pieces[worker]:
        key = (p.dest, p.expert)
        src = shards[p.src, p.owner.tp]
        if p.dim is None:
            out[key].copy_(src)
            cover[key] += 1
            continue
        out[key].narrow(p.dim, p.dest_start, p.length).copy_(src.narrow(p.dim, p.src_start, p.length))
        cover[key][p.dest_start : p.dest_start + p.length] += 1
    return out, cover


def _check_plan(plan, desc, reader, hf, references: dict) -> None:
    shards = _trainer_shards(plan, desc, reader)
    for worker, (server, rank) in enumerate(plan.workers):
        size = plan.server_tp[server]
        got, cover = _assemble(plan, worker, shards)
        for local in plan.local[worker]:
            key = (local.name, local.expert)
            ref_key = (local.name, local.expert, size, rank)
            if ref_key not in references:
                references[ref_key] = reference_local(local.name, local.expert, hf, desc.dims, size, rank)
            ref = references[ref_key]
            padding = sum(s.length for s in local.segments if s.hf is None)
            real = ref.shape[0] - padding if local.dim == 0 else None
            assert torch.equal(got[key][:real], ref[:real]), (plan.trainer, size, rank, key)
            covered = cover[key][:real] if local.dim is not None else cover[key]
            assert bool((covered == 1).all()), f"{key}: rows covered {covered.unique().tolist()} times"


@pytest.mark.parametrize("model", list(FAMILY_LAYOUTS), indirect=True)
def test_sharded_pieces_rebuild_vllm_local_shards(model):
    family, path, reader, hf = model
    references: dict = {}
    layouts = FAMILY_LAYOUTS[family] + _random_layouts(len(family), 2, moe=family == "qwen3_moe")
    shapes = {n: reader.shape(n) for n in reader.keys()}  # noqa: SIM118 (the reader is not iterable)
    for layout in layouts:
        desc = describe(path, layout.tp)
        plan = build_plan(desc, shapes, layout, (1, 2, 4))  # TP 4 > 2 KV heads: KV heads replicated
        _check_plan(plan, desc, reader, hf, references)


@pytest.mark.parametrize("model", ["qwen3_moe"], indirect=True)
def test_broadcast_senders_cover_every_hf_tensor_once(model):
    _, path, reader, _ = model
    layout = TrainingAllocation(tp=2, pp=2, vpp=2, ep=2, etp=1, dp=2)
    desc = describe(path, layout.tp)
    plan = build_plan(desc, {n: reader.shape(n) for n in reader.keys()}, layout, (2,), sharded=False)  # noqa: SIM118 (the reader is not iterable)
    senders = plan.broadcast_senders()
    sent = [n for params in senders.values() for src in params for n in src.hf_names]
    assert sorted(sent) == sorted(reader.keys())  # untied: lm_head included, each tensor once
    num_experts = desc.hf_config.num_experts
    for owner, params in senders.items():
        for src in params:
            assert (owner.pp, owner.expert) == (src.pp, src.rule.is_expert)
            if owner.expert:
                expert = int(src.megatron.split("local_experts.")[1].split(".")[0])
                assert owner.ep == expert // (num_experts // layout.ep)


def test_tied_embeddings_are_sent_once(tiny_model_dir):
    path = tiny_model_dir("llama", tie_word_embeddings=True)
    reader = SafetensorsReader(path)
    plan = build_plan(
        describe(path, 2), {n: reader.shape(n) for n in reader.keys()}, TrainingAllocation(tp=2, pp=2), (2,)
    )  # noqa: SIM118 (the reader is not iterable)
    names = [n for n, _ in plan.hf_tensors()]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    dests = [p.dest for p in plan.pieces[0]]
    assert "lm_head.weight" not in dests


@pytest.mark.parametrize(("pp", "vpp"), [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_layer_placement_matches_megatron(pp, vpp):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_layers = 16
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )
    layout = TrainingAllocation(pp=pp, vpp=vpp)
    per_chunk = num_layers // (pp * vpp)
    for stage in range(pp):
        for chunk in range(vpp):
            offset = get_transformer_layer_offset(config, vp_stage=chunk if vpp > 1 else None, pp_rank=stage)
            for layer in range(offset, offset + per_chunk):
                assert layout.place_layer(layer, num_layers) == (stage, chunk)


@pytest.mark.parametrize("model", ["llama"], indirect=True)
def test_sharded_bytes_per_worker_are_model_bytes_over_tp(model):
    _, path, reader, _ = model
    desc = describe(path, 2)
    plan = build_plan(desc, {n: reader.shape(n) for n in reader.keys()}, TrainingAllocation(tp=2), (1, 2, 4))  # noqa: SIM118 (the reader is not iterable)
    total = plan.model_numel()
    hidden = desc.hf_config.hidden_size
    replicated = sum(math.prod(reader.shape(n)) for n in reader.keys() if n.endswith("norm.weight"))  # noqa: SIM118 (the reader is not iterable)
    kv = sum(math.prod(reader.shape(n)) for n in reader.keys() if n.endswith(("k_proj.weight", "v_proj.weight")))  # noqa: SIM118 (the reader is not iterable)
    assert plan.worker_numel(0) == total
    for server, tp in enumerate(plan.server_tp):
        copies = max(1, tp // desc.dims.num_query_groups)  # KV heads replicated when tp > KV heads
        workers = [plan.worker_index(server, r) for r in range(tp)]
        assert sum(plan.worker_numel(w) for w in workers) == total + (tp - 1) * replicated + (copies - 1) * kv
        for w in workers:  # vLLM pads the vocabulary to 64 rows before splitting it: shares differ by < 64 rows
            share = (total - replicated - kv) / tp + replicated + kv * copies / tp
            assert abs(plan.worker_numel(w) - share) < 2 * 64 * hidden


def test_layouts_reject_bad_sizes(tiny_model_dir):
    path = tiny_model_dir("llama")
    reader = SafetensorsReader(path)
    shapes = {n: reader.shape(n) for n in reader.keys()}  # noqa: SIM118 (the reader is not iterable)
    with pytest.raises(ValueError, match="inference tensor-parallel size 3"):
        build_plan(describe(path, 1), shapes, TrainingAllocation(), (3,))
    with pytest.raises(ValueError, match="do not split evenly"):
        build_plan(describe(path, 1), shapes, TrainingAllocation(pp=3), (1,))
