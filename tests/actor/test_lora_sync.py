"""LoRA adapters in the weight sync (merged) and in checkpoints, on CPU (gloo, fp32), single rank and TP2.

Each run loads ``lora_workers.nonzero_adapter``'s adapters and takes one Adam step, then:

* the HF tensors the weight bridge gathers (``ShardSource.gather_hf``, what every transport sends)
  equal, within 1e-6, the HF model with the run's adapters merged by an independent route: HF
  ``peft``'s ``merge_and_unload()`` on the PEFT directory the run exports; the merged HF export
  (``engine.export_hf``) too; the base weights keep every bit;
* a checkpoint saved, then the adapters and the optimizer state perturbed, then the checkpoint
  loaded: adapters, main parameters, Adam moments and step bit-identical to those saved (the
  single-rank run with the distributed optimizer, TP2 without it: its state follows the model's
  sharding metadata, which must record each adapter matrix's split).
"""

from __future__ import annotations

import pytest
import torch

from tests.actor.dist_utils import run_ranks
from tests.actor.lora_workers import DENSE
from tests.actor.workers import make_batch

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def _peft_merged(model_dir, peft_dir) -> dict[str, torch.Tensor]:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, str(peft_dir)).merge_and_unload().state_dict()


PER_MODULE = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Adapters per HF module (PEFT's form), k_proj left without one."""


@pytest.mark.parametrize(
    "alloc,distributed,targets",
    [("d1p1t1", True, DENSE), ("d1p1t2", False, DENSE), pytest.param("d1p1t2", False, PER_MODULE, id="per-module")],
)
def test_merged_sync_and_checkpoint_carry_the_adapters(llama_dir, tmp_path, alloc, distributed, targets):
    from megarl.models.hf_io import SafetensorsReader

    world = 2 if alloc.endswith("t2") else 1
    batch = make_batch([7, 12, 5, 9], seed=3)
    results = run_ranks(
        world,
        "tests.actor.lora_sync_workers:lora_sync_run",
        model_dir=str(llama_dir),
        alloc=alloc,
        batch=batch,
        out_dir=str(tmp_path),
        distributed_optimizer=distributed,
        targets=targets,
    )
    for r in results:
        assert r["n_merged"] == 4 * 4  # qkv, proj, fc1, fc2 of 4 layers
        assert r["cached"] and r["base_bits_kept"]
        assert r["n_adapters"] == 4 * 4 * 2 and r["n_optim"] > 0 and r["perturbed"]
        assert r["adapters_restored"] and r["optim_restored"] and r["base_after_load"]
        assert r["version"] == 7
        # the gathered adapters own their memory: a view of Megatron's parameter buffer pickles all of it
        assert r["pickled_bytes"] < 1.2 * r["adapter_bytes"] + 64 * 1024, (r["pickled_bytes"], r["adapter_bytes"])

    want = _peft_merged(llama_dir, tmp_path / "peft")
    base = SafetensorsReader(llama_dir)
    exported = SafetensorsReader(tmp_path / "hf")
    merged = results[0]["merged"]
    assert set(merged) <= set(want) and len(merged) == len(list(exported.keys()))
    moved = 0
    for name, tensor in merged.items():
        assert (tensor - want[name]).abs().max().item() <= 1e-6, name
        assert (exported(name, None, 0, 0) - want[name]).abs().max().item() <= 1e-6, name
        moved += (tensor - base(name, None, 0, 0)).abs().max().item() > 1e-4
    # q, k, v, o, gate, up, down of 4 layers: the adapters are in (k has none per module: k_proj keeps its bits)
    assert moved == 4 * (7 if targets == DENSE else 6)


CHECKPOINT_AT = "tests.actor.lora_sync_workers:lora_checkpoint_at"


@pytest.mark.parametrize(
    "saved_at,loaded_at,distributed,targets",
    # TP1 -> TP2 splits what TP2 -> TP1 gathers: the other direction runs with the slow tests
    [
        ("d1p1t2", "d1p1t1", False, DENSE),
        ("d1p1t2", "d1p1t1", True, DENSE),
        pytest.param("d1p1t1", "d1p1t2", False, DENSE, marks=pytest.mark.slow),
        pytest.param("d1p1t2", "d1p1t1", True, PER_MODULE, id="per-module"),
    ],
)
def test_a_checkpoint_with_adapters_resumes_at_another_tensor_parallel_size(
    llama_dir, tmp_path, saved_at, loaded_at, distributed, targets
):
    """Adapters and their Adam moments saved at one TP size load at another: each adapter's TP split is
    recorded in the checkpoint, so the gathered matrices and moments are bit-identical, with the plain
    optimizer and with the distributed one (its state written per parameter: ``checkpoint_layout: any``)."""
    batch = make_batch([7, 12, 5, 9], seed=3)
    common = {"model_dir": str(llama_dir), "batch": batch, "ckpt": str(tmp_path / "c"), "targets": targets}
    world = {"d1p1t1": 1, "d1p1t2": 2}
    saved = run_ranks(world[saved_at], CHECKPOINT_AT, alloc=saved_at, save=True, distributed=distributed, **common)[0]
    loaded = run_ranks(world[loaded_at], CHECKPOINT_AT, alloc=loaded_at, save=False, distributed=distributed, **common)
    loaded = loaded[0]
    assert loaded["steps"] == saved["steps"] == [1]
    for key in ("adapters", "exp_avg", "exp_avg_sq"):
        assert sorted(loaded[key]) == sorted(saved[key]) and len(saved[key]) == 4 * 4 * 2
        for name, tensor in saved[key].items():
            assert torch.equal(loaded[key][name], tensor), (key, name)
    assert any(t.abs().sum() > 0 for t in saved["exp_avg"].values())
