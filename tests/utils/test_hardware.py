"""``dtype: auto``: the CPU's flags decide, once; the whole run (trainer, servers, wire) follows."""

from __future__ import annotations

import logging

import pytest

from megarl.config import GRPOConfig, VLLMConfig
from megarl.run.prelaunch import build_config
from megarl.serving import vllm_launch_spec
from megarl.utils import hardware

AVX2 = frozenset({"avx2", "fma", "sse4_2"})
SAPPHIRE_RAPIDS = AVX2 | {"avx512f", "avx512_bf16", "amx_bf16"}


@pytest.fixture
def cpu(monkeypatch):
    """Pretend this machine has the given CPU flags."""

    def use(flags: frozenset[str]) -> None:
        info = hardware.CPUInfo(model="Test CPU", flags=frozenset(flags), cores=2)
        monkeypatch.setattr(hardware, "cpu_info", lambda: info)

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    return use


def _config(*overrides: str) -> GRPOConfig:
    return build_config(GRPOConfig, ["configs/gsm8k_grpo_cpu.yaml"], list(overrides))


def test_cpu_info_reads_this_machine():
    info = hardware.cpu_info()
    assert info.cores >= 1 and info.model
    assert ("avx2" in info.flags) == ("avx2" in open("/proc/cpuinfo").read())


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (AVX2, "float32"),
        (AVX2 | {"avx512f"}, "float32"),
        (SAPPHIRE_RAPIDS, "bfloat16"),
        (AVX2 | {"avx512_bf16"}, "bfloat16"),
    ],
)
def test_auto_follows_the_bf16_instructions(cpu, flags, want):
    cpu(flags)
    assert hardware.auto_dtype("cpu")[0] == want
    assert hardware.auto_dtype("cuda")[0] == "bfloat16"


@pytest.mark.parametrize(("flags", "cost"), [(AVX2, "over 100x slower"), (AVX2 | {"avx512f"}, "3-5x slower")])
def test_the_reason_says_what_emulated_bf16_costs_here(cpu, flags, cost):
    """AVX-512 emulates bf16 products at a third to a fifth of fp32's speed, AVX2 alone at under a hundredth
    (benchmarks/results/bf16_matmul_avx512.md, bf16_matmul_avx2.md)."""
    cpu(flags)
    assert f"bf16 matmuls are emulated ({cost} than fp32)" in hardware.auto_dtype("cpu")[1]


def test_onednn_isa_cap_counts_as_no_native_bf16(cpu, monkeypatch):
    cpu(SAPPHIRE_RAPIDS)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    dtype, why = hardware.auto_dtype("cpu")
    assert dtype == "float32" and "ONEDNN_MAX_CPU_ISA=AVX2" in why
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_amx")
    assert hardware.auto_dtype("cpu")[0] == "bfloat16"


@pytest.mark.parametrize(("flags", "want"), [(AVX2, "float32"), (SAPPHIRE_RAPIDS, "bfloat16")])
def test_config_resolves_trainer_server_and_wire_together(cpu, caplog, flags, want):
    cpu(flags)
    with caplog.at_level(logging.INFO, logger="megarl.config"):
        config = _config("actor.kl_ctl=0.1", "ref.path=smollm2")
    assert config.dtypes() == {"actor.dtype": want, "ref.dtype": want, "vllm.dtype": want, "weight_update.dtype": want}
    lines = [r.getMessage() for r in caplog.records if r.name == "megarl.config"]
    assert len(lines) == 1 and lines[0].startswith(f"dtype {want} for actor.dtype, ref.dtype, vllm.dtype")
    assert "Test CPU" in lines[0]


def test_explicit_dtype_wins_and_bf16_on_avx2_warns(cpu, caplog):
    cpu(AVX2)
    with caplog.at_level(logging.INFO, logger="megarl.config"):
        config = _config("vllm.dtype=bfloat16")
    assert config.vllm.dtype == "bfloat16" and config.weight_update.dtype == "bfloat16"  # the wire follows the servers
    assert config.actor.dtype == "float32"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "vllm.dtype" in warnings[0] and "without native bf16" in warnings[0]
    caplog.clear()
    cpu(SAPPHIRE_RAPIDS)
    _config("actor.dtype=bfloat16")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_saved_config_is_concrete_and_not_decided_again(cpu, tmp_path, caplog):
    from megarl.config import save_config

    cpu(AVX2)
    path = save_config(_config(), tmp_path / "config.yaml")
    assert "dtype: auto" not in path.read_text()
    cpu(SAPPHIRE_RAPIDS)  # a trainer on another machine reads the launcher's decision
    caplog.clear()  # the launcher's own decision above is logged too (when INFO is enabled)
    with caplog.at_level(logging.INFO, logger="megarl.config"):
        again = build_config(GRPOConfig, [str(path)], [])
    decided = [r.getMessage() for r in caplog.records if "dtype" in r.getMessage()]
    assert again.actor.dtype == "float32" and not decided, decided


def test_vllm_spec_resolves_auto_for_its_device(cpu, run_key):
    cpu(AVX2)
    spec = vllm_launch_spec(VLLMConfig(), "/m", "127.0.0.1", 8000)
    assert spec.cmd[spec.cmd.index("--dtype") + 1] == "float32"
    cpu(SAPPHIRE_RAPIDS)
    spec = vllm_launch_spec(VLLMConfig(), "/m", "127.0.0.1", 8000)
    assert spec.cmd[spec.cmd.index("--dtype") + 1] == "bfloat16"
