"""An adapter's output scale as each reader of its PEFT directory computes it: ``alpha / r``, or
``alpha / sqrt(r)`` with rank-stabilised LoRA (``use_rslora``). megarl's export keeps PEFT's settings
(HF ``peft`` reads them back as written); the copy the servers load (adapter weight sync) writes the
same scale as plain ``lora_alpha / r``, since SGLang computes ``lora_alpha / r`` whatever
``use_rslora`` says and vLLM honours it."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.config.train import LoRAConfig
from megarl.models.lora import write_peft_dir
from megarl.models.peft_files import lora_scale

RANK, ALPHA = 16, 32.0
TENSORS = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(RANK, 8),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, RANK),
}


def test_the_scale_is_alpha_over_r_or_over_its_square_root():
    assert lora_scale(RANK, ALPHA) == 2.0
    assert lora_scale(RANK, ALPHA, use_rslora=True) == 8.0


@pytest.mark.parametrize("use_rslora", [False, True])
def test_the_export_keeps_peft_settings_and_the_servers_copy_their_scale(tmp_path, use_rslora):
    peft = pytest.importorskip("peft")
    from vllm.lora.peft_helper import PEFTHelper

    settings = LoRAConfig(rank=RANK, alpha=ALPHA, use_rslora=use_rslora, target_modules=["q_proj"])
    scale = lora_scale(RANK, ALPHA, use_rslora)
    export = write_peft_dir(TENSORS, settings, "base", tmp_path / "export")
    read = peft.LoraConfig.from_pretrained(str(export))
    assert (read.r, read.lora_alpha, read.use_rslora) == (RANK, ALPHA, use_rslora)

    served = write_peft_dir(TENSORS, settings, "base", tmp_path / "served", for_servers=True)
    config = json.loads((served / "adapter_config.json").read_text())
    assert config["lora_alpha"] / config["r"] == pytest.approx(scale, rel=1e-12)  # SGLang's scaling
    vllm_scale = PEFTHelper.from_local_dir(str(served), None).vllm_lora_scaling_factor
    assert vllm_scale == pytest.approx(scale, rel=1e-12)
    assert PEFTHelper.from_local_dir(str(export), None).vllm_lora_scaling_factor == pytest.approx(scale, rel=1e-12)
