"""LoRA adapters on the Megatron actor (``megarl.models.lora``): parity over parallel layouts, on CPU (gloo, fp32).

Every run loads the same full adapter matrices (``lora_workers.nonzero_adapter``, B nonzero so
that the adapters change the outputs), split for its layout. References: the single-rank LoRA
model, itself checked against plain torch LoRA hooks on the HF transformers model
(``W x + (alpha / r) B A x`` on q/k/v, o, gate/up and down, with the fused QKV and gate/up
matrices of the adapter split by megarl's HF mapping). Each layout's logprobs and full adapter
gradients must be within 1e-5 of the single-rank model's; the base stays frozen (no gradient
buffer, unchanged by the Adam step). The TP2 run also loads the adapters with a split swapped
(A of a column-parallel layer split, B of a row-parallel layer split, linear_fc1's B as one
block): each must change the logprobs far beyond the tolerance. The single-rank and PP2 runs export
their adapters as PEFT directories: the same tensors, and HF ``peft`` on the HF model gives the
LoRA model's logprobs; PP2 (and TP2 x PP2) start from the single-rank export (``lora.init_from``).
"""

from __future__ import annotations

import contextlib
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.actor.dist_utils import assert_grads_close, dp_rows, run_layout
from tests.actor.lora_workers import ALPHA, RANK, WRONG_SPLITS, nonzero_adapter, random_peft_adapter
from tests.actor.workers import make_batch

pytestmark = pytest.mark.multiproc

LENGTHS = [7, 12, 5, 9, 11, 6]
TOL = 1e-5
MOE_TARGETS = ["linear_qkv", "linear_proj", "experts.linear_fc1", "experts.linear_fc2"]


@pytest.fixture(scope="module")
def batch():
    return make_batch(LENGTHS, seed=3)


def _run(model_dir, alloc: str, batch, **kwargs) -> dict:
    """``lora_run`` on every rank of ``alloc``: DP rows merged, per-stage / per-expert gradients merged."""
    results = run_layout(alloc, "tests.actor.lora_workers:lora_run", model_dir=str(model_dir), batch=batch, **kwargs)
    merged = {key: [r[key] for r in results] for key in results[0] if key not in ("logp", "logp_after", "wrong")}
    for key in ("logp", "logp_after"):
        merged[key] = dp_rows(results, key, batch["input_ids"].shape)
    merged["grads"] = {name: g for r in results for name, g in r["grads"].items()}
    merged["rank_grads"] = [r["grads"] for r in results]
    merged["adapters_after"] = {name: a for r in results for name, a in r["adapters_after"].items()}
    if "wrong" in results[0]:
        merged["wrong"] = {
            what: dp_rows([{**r, "logp": r["wrong"][what]} for r in results], "logp", batch["input_ids"].shape)
            for what in WRONG_SPLITS
        }
    return merged


def _assert_matches(layout: dict, ref: dict) -> None:
    assert all(layout["base_frozen"]) and all(layout["base_unchanged"])
    assert (layout["logp"] - ref["logp"]).abs().max() <= TOL
    assert all(abs(loss - ref["loss"][0]) <= 1e-6 for loss in layout["loss"])
    assert set(layout["grads"]) == set(ref["grads"])
    for grads in layout["rank_grads"]:  # every replica of a replicated matrix, too
        assert_grads_close(grads, {name: ref["grads"][name] for name in grads}, TOL)
    assert all(norm == pytest.approx(ref["grad_norm"][0], rel=TOL) for norm in layout["grad_norm"])
    assert (layout["logp_after"] - ref["logp_after"]).abs().max() <= 10 * TOL


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def peft_dirs(tmp_path_factory):
    """Where runs export their adapters (PEFT), by layout."""
    base = tmp_path_factory.mktemp("lora_peft")
    return lambda alloc: str(base / alloc)


@pytest.fixture(scope="module")
def llama_ref(llama_dir, batch, peft_dirs):
    return _run(llama_dir, "d1p1t1", batch, measure_full=True, peft_dir=peft_dirs("d1p1t1"))


def _add_lora(module, args, output, a, b):
    return output + (args[0] @ a.t() @ b.t()) * (ALPHA / RANK)


def _hf_with_lora(model_dir, batch, shapes: dict) -> dict:
    """Logprobs, token-mean PPO loss and adapter gradients (Megatron layout) of the HF model with torch LoRA hooks."""
    from transformers import AutoModelForCausalLM

    from megarl.models.build import describe
    from megarl.models.mapping import export_from_shards

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).requires_grad_(False)
    desc = describe(str(model_dir))
    leaves = {name: nonzero_adapter(name, shape).requires_grad_() for name, shape in shapes.items()}
    for prefix in {name.rsplit(".adapter.", 1)[0] for name in leaves}:
        rule, fields = desc.mapping.match(f"{prefix}.weight")
        b_parts = export_from_shards(rule, rule.hf_names(**fields), [leaves[f"{prefix}.adapter.lora_b"]], desc.dims)
        for hf_name, b in b_parts.items():
            hook = partial(_add_lora, a=leaves[f"{prefix}.adapter.lora_a"], b=b)
            model.get_submodule(hf_name.removesuffix(".weight")).register_forward_hook(hook)
    return {**_hf_logp_and_loss(model, batch), "grads": {name: t.grad for name, t in leaves.items()}}


def _hf_logp_and_loss(model, batch) -> dict:
    """An HF model's logprobs of ``batch`` (zero-padded as the engine returns them) and its token-mean PPO
    loss, whose gradient is left in the model."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    logp = model(ids, attention_mask=attn).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:].bool() & attn[:, 1:]
    ratio = torch.exp(logp - batch["logprobs"][:, 1:])
    adv = batch["advantages"][:, 1:]
    loss = (-torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / mask.sum()
    loss.backward()
    padded = torch.zeros(ids.shape)
    padded[:, :-1] = logp.detach() * attn[:, 1:]
    return {"logp": padded, "loss": loss.item()}


def test_single_rank_lora_matches_torch_lora_on_hf(llama_dir, llama_ref, batch):
    shapes = {name: tuple(g.shape) for name, g in llama_ref["grads"].items()}
    assert len(shapes) == 4 * 4 * 2  # 4 layers x qkv, proj, fc1, fc2 x (A, B)
    hf = _hf_with_lora(llama_dir, batch, shapes)
    assert (llama_ref["logp"] - hf["logp"]).abs().max() <= 1e-4
    assert abs(llama_ref["loss"][0] - hf["loss"]) <= 1e-5
    assert_grads_close(llama_ref["grads"], hf["grads"], 1e-4)


def test_only_adapters_train(llama_ref):
    """Frozen base: no gradient buffer, no optimizer state; the optimizer holds exactly the adapters."""
    assert llama_ref["base_frozen"] == [True] and llama_ref["base_unchanged"] == [True]
    n_adapter = llama_ref["n_adapter_params"][0]
    # per layer: qkv 128 -> 512, proj 256 -> 128, fc1 128 -> 2 x 256, fc2 256 -> 128
    assert n_adapter == 4 * RANK * ((128 + 512) + (256 + 128) + (128 + 512) + (256 + 128))
    assert llama_ref["optimizer_params"] == [n_adapter]
    assert llama_ref["grad_buffer_bytes"][0] < 4 * n_adapter + 4096  # fp32 grads, plus bucket padding
    full = llama_ref["full_model"][0]
    assert full["optimizer_params"] > 100 * n_adapter and full["grad_buffer_bytes"] >= 4 * full["optimizer_params"]
    assert any((a != nonzero_adapter(n, a.shape)).any() for n, a in llama_ref["adapters_after"].items())


@pytest.fixture(scope="module")
def tp2(llama_dir, batch):
    """TP2 with sequence parallelism; also the logprobs with each of :data:`WRONG_SPLITS`."""
    return _run(llama_dir, "d1p1t2", batch, wrong_splits=True)


def test_tp2_with_sequence_parallel_matches_single_rank(tp2, llama_ref):
    _assert_matches(tp2, llama_ref)


@pytest.mark.parametrize("what", list(WRONG_SPLITS))
def test_parity_catches_a_swapped_split(tp2, llama_ref, what):
    """The same full matrices split the wrong way over TP2 (local shapes unchanged, so the model runs)."""
    assert (tp2["wrong"][what] - llama_ref["logp"]).abs().max() > 1e-2


def test_peft_export_gives_the_same_model_in_peft(llama_dir, llama_ref, batch, peft_dirs):
    """The exported adapter directory, loaded by HF ``peft`` on the HF model: the LoRA model's logprobs."""
    pytest.importorskip("peft")
    assert (_peft_logp(llama_dir, peft_dirs("d1p1t1"), batch) - llama_ref["logp"]).abs().max() <= 1e-4
    base = _peft_logp(llama_dir, peft_dirs("d1p1t1"), batch, adapter=False)
    assert (base - llama_ref["logp"]).abs().max() > 1e-2  # the adapters matter: the base model is far off


def _peft_logp(model_dir, peft_dir, batch, adapter: bool = True) -> torch.Tensor:
    """HF ``peft``'s logprobs of ``batch`` with the adapter ``peft_dir`` on the HF model (``adapter=False``:
    with it disabled)."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(peft_dir)).eval()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad(), contextlib.nullcontext() if adapter else model.disable_adapter():
        logits = model(input_ids=ids, attention_mask=attn).logits
    out = torch.zeros(ids.shape)
    out[:, :-1] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * attn[:, 1:]
    return out


def _peft_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{path}/adapter_model.safetensors")


@pytest.mark.parametrize(
    "alloc,kwargs",
    [
        pytest.param(
            "d1p2t1",
            {"distributed_optimizer": True, "recompute": True, "init_from": "d1p1t1"},
            id="d1p2t1-dist-opt-recompute-init-from-peft",
        ),
        pytest.param("d1p2t1v2", {}, id="d1p2t1v2", marks=pytest.mark.slow),
        pytest.param(
            "d1p2t2",
            {"sequence_parallel": False, "init_from": "d1p1t1"},
            id="d1p2t2-no-sp-init-from-peft",
            marks=pytest.mark.slow,  # 4 ranks on the 2-core CI machine: ~15 s
        ),
    ],
)
def test_layout_matches_single_rank(llama_dir, llama_ref, batch, peft_dirs, alloc, kwargs):
    """Parity, and the same PEFT export as the single-rank model's (gathered over TP, sent from each stage).
    ``init_from``: start from the PEFT directory that layout exported instead of loading the adapters."""
    if "init_from" in kwargs:
        kwargs["init_from"] = peft_dirs(kwargs["init_from"])
    _assert_matches(_run(llama_dir, alloc, batch, peft_dir=peft_dirs(alloc), **kwargs), llama_ref)
    got, want = _peft_tensors(peft_dirs(alloc)), _peft_tensors(peft_dirs("d1p1t1"))
    assert set(got) == set(want) and all(torch.equal(got[name], want[name]) for name in want)


def test_experts_over_ep2_match_single_rank(tiny_model_dir, batch):
    """Adapters on attention and on every expert's linears (Qwen3-MoE); EP2 with DP2 (experts' grads reduce
    over their own data-parallel group, the dense ones over DP)."""
    moe_dir = tiny_model_dir("qwen3_moe")
    ref = _run(moe_dir, "d1p1t1", batch, targets=MOE_TARGETS)
    assert sum(".experts." in name for name in ref["grads"]) == 4 * 4 * 2 * 2  # layers x experts x fc1/2 x A/B
    _assert_matches(_run(moe_dir, "d2p1t1e2", batch, targets=MOE_TARGETS), ref)


def test_init_from_refuses_what_the_fused_adapters_cannot_hold(llama_dir, llama_ref, peft_dirs, tmp_path):
    """A PEFT directory whose q/k/v lora_A differ (trained elsewhere), or whose r / lora_alpha differ from
    the config's: a clear error naming the modules or the keys."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from megarl.config.train import LoRAConfig
    from megarl.models.build import describe
    from megarl.models.lora import peft_full

    shutil.copytree(peft_dirs("d1p1t1"), tmp_path / "peft")
    weights = tmp_path / "peft" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] += 1.0
    save_file(tensors, str(weights))
    desc, settings = describe(str(llama_dir)), LoRAConfig(rank=RANK, alpha=ALPHA)
    full_of = peft_full(tmp_path / "peft", desc, settings)
    name = "decoder.layers.0.self_attention.linear_qkv.adapter.lora_a"
    with pytest.raises(ValueError, match="k_proj.weight.*have different lora_A.*name its HF modules in actor.lora"):
        full_of(name, tuple(llama_ref["grads"][name].shape))
    config = tmp_path / "peft" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_alpha": 2 * ALPHA}))
    with pytest.raises(ValueError, match="lora_alpha=16.0 in adapter_config.json, but lora.alpha=8.0"):
        peft_full(tmp_path / "peft", desc, settings)


# --- an adapter per HF module (PEFT's form): target_modules by HF name --------------------------------------

PEFT_TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""k_proj left out: its rows of the fused QKV get no adapter, between the q and v rows of every query group."""


@pytest.fixture(scope="module")
def trained_elsewhere(llama_dir, tmp_path_factory):
    """A PEFT adapter made by HF ``peft`` on the HF model, as one trained with PEFT or TRL: every module its
    own ``lora_A`` and ``lora_B``, all nonzero (random), saved by ``save_pretrained``."""
    pytest.importorskip("peft")
    return random_peft_adapter(llama_dir, tmp_path_factory.mktemp("peft_elsewhere"), PEFT_TARGETS, RANK, ALPHA)


@pytest.fixture(scope="module")
def per_module(llama_dir, batch, trained_elsewhere, peft_dirs):
    """The single-rank engine with PEFT's modules as targets, started from :func:`trained_elsewhere`."""
    kwargs = {"targets": PEFT_TARGETS, "init_from": str(trained_elsewhere), "peft_dir": peft_dirs("per-module")}
    return _run(llama_dir, "d1p1t1", batch, peft_dir_after=peft_dirs("per-module-after"), **kwargs)


def _peft_reference(model_dir, peft_dir, batch) -> dict:
    """HF ``peft``'s model of ``peft_dir`` on the HF model: logprobs, loss and the adapters' gradients by PEFT name."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(peft_dir), is_trainable=True)
    out = _hf_logp_and_loss(model, batch)
    out["grads"] = {n.replace(".default", ""): q.grad for n, q in model.named_parameters() if q.requires_grad}
    return out


def test_adapters_per_hf_module_start_from_a_peft_adapter_and_match_peft(
    llama_dir, batch, per_module, trained_elsewhere, peft_dirs
):
    """An adapter trained elsewhere (each module its own lora_A) loads, computes what HF ``peft`` computes
    with it (logprobs, loss, every adapter matrix's gradient), and exports back bit for bit."""
    from megarl.models.build import describe
    from megarl.models.lora import peft_tensors

    ref = _peft_reference(llama_dir, trained_elsewhere, batch)
    assert len(ref["grads"]) == 4 * len(PEFT_TARGETS) * 2
    assert (per_module["logp"] - ref["logp"]).abs().max() <= 1e-4
    assert abs(per_module["loss"][0] - ref["loss"]) <= 1e-5
    assert_grads_close(peft_tensors(per_module["grads"], describe(str(llama_dir)), PEFT_TARGETS), ref["grads"], 1e-4)
    got, want = _peft_tensors(peft_dirs("per-module")), _peft_tensors(str(trained_elsewhere))
    assert set(got) == set(want) and all(torch.equal(got[name], want[name]) for name in want)
    assert per_module["base_frozen"] == [True] and per_module["base_unchanged"] == [True]


def test_an_rslora_adapter_computes_what_peft_does_with_it(llama_dir, batch, peft_dirs, tmp_path_factory):
    """An adapter trained with rank-stabilised scaling (``alpha / sqrt(r)``: twice ``alpha / r`` at rank 4)
    gives HF ``peft``'s logprobs, loss and gradients with ``use_rslora``, and exports as it came."""
    import json

    from megarl.models.build import describe
    from megarl.models.lora import peft_tensors

    out = tmp_path_factory.mktemp("peft_rslora")
    rslora = random_peft_adapter(llama_dir, out, PEFT_TARGETS, RANK, ALPHA, use_rslora=True)
    kwargs = {"targets": PEFT_TARGETS, "init_from": str(rslora), "use_rslora": True, "peft_dir": peft_dirs("rslora")}
    run = _run(llama_dir, "d1p1t1", batch, **kwargs)
    ref = _peft_reference(llama_dir, rslora, batch)
    assert (run["logp"] - ref["logp"]).abs().max() <= 1e-4
    assert abs(run["loss"][0] - ref["loss"]) <= 1e-5
    assert_grads_close(peft_tensors(run["grads"], describe(str(llama_dir)), PEFT_TARGETS), ref["grads"], 1e-4)
    exported = json.loads((Path(peft_dirs("rslora")) / "adapter_config.json").read_text())
    assert exported["use_rslora"] is True and exported["lora_alpha"] == ALPHA


def test_adapters_per_hf_module_stay_per_module_as_they_train(llama_dir, batch, per_module, peft_dirs):
    """After an Adam step the trained model is still PEFT's form: its export, loaded by HF ``peft``, gives the
    engine's logprobs after the step (a fused linear's rows learning from other modules' A would not export)."""
    assert (per_module["logp_after"] - per_module["logp"]).abs().max() > 1e-3  # the step moved the adapters
    assert (_peft_logp(llama_dir, peft_dirs("per-module-after"), batch) - per_module["logp_after"]).abs().max() <= 1e-4


def test_adapters_per_hf_module_over_tp2_match_single_rank(llama_dir, batch, per_module, trained_elsewhere):
    """TP2 with sequence parallelism: each rank's rows of the fused QKV (grouped q, k, v) and gate / up keep
    their own module's adapter; logprobs, gradients and the step after within 1e-5 of one rank."""
    kwargs = {"targets": PEFT_TARGETS, "init_from": str(trained_elsewhere)}
    _assert_matches(_run(llama_dir, "d1p1t2", batch, **kwargs), per_module)


def test_one_fused_adapter_refuses_a_peft_adapter_naming_the_way_out(llama_dir, trained_elsewhere):
    """With Megatron's names (one adapter per fused linear) PEFT's adapter on q, v, o, gate, up and down is
    refused before anything loads, naming the modules it lacks and the ones it has."""
    from megarl.config.train import LoRAConfig
    from megarl.models.build import describe
    from megarl.models.lora import peft_full

    settings = LoRAConfig(rank=RANK, alpha=ALPHA)
    with pytest.raises(ValueError, match=r"adapt \['k_proj'\], which the adapter has no weights for \(its modules"):
        peft_full(trained_elsewhere, describe(str(llama_dir)), settings)


# --- the KL reference of a LoRA actor: its own model with the adapters it started from ------------------------


@pytest.mark.parametrize(
    "alloc,start",
    [("d1p1t1", "peft-init"), ("d1p1t1", "init-from"), ("d1p1t2", "init-from"), ("d2p1t1", "init-from-overlap")],
    ids=str,
)
def test_a_lora_actor_scores_its_own_kl_reference(llama_dir, batch, trained_elsewhere, alloc, start):
    """Without a reference model the KL reference is the actor's initial weights, scored by the actor's model
    with the adapters it started from: the base model (HF) after PEFT's initialisation (B = 0), the base with
    the adapter it started from (HF ``peft``) after ``init_from``; before and after an Adam step, within 1e-4
    of HF in fp32, while the actor's own logprobs have moved; the actor's adapters keep every bit. Also with
    the distributed optimizer's all-gather of the trained adapters overlapped with the next forward (the
    reference's): it lands before the reference sets its adapters, not during its pass."""
    kwargs = {"targets": PEFT_TARGETS, "init_from": str(trained_elsewhere)} if start != "peft-init" else {}
    if start == "init-from-overlap":
        kwargs["overlap"] = True
    target = "tests.actor.lora_workers:lora_reference_run"
    results = run_layout(alloc, target, model_dir=str(llama_dir), batch=batch, **kwargs)
    got = {key: dp_rows(results, key, batch["input_ids"].shape) for key in ("ref_before", "ref_after", "logp")}
    want = _peft_logp(llama_dir, trained_elsewhere, batch, adapter=start != "peft-init")
    assert (got["ref_before"] - want).abs().max() <= 1e-4
    assert (got["ref_after"] - want).abs().max() <= 1e-4
    moved = (got["logp"] - want).abs().max()
    assert moved > 1e-3, moved  # the actor moved; its reference did not
    assert all(r["adapters_kept"] for r in results)
