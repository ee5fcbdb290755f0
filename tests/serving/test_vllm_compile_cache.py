"""megarl.serving.vllm_compile_cache: a loaded inductor artifact gets the ``finalize_loading`` vLLM's loader
calls, and the cache key tells CPU kinds apart. The whole path (a compiled vLLM-CPU server started twice)
is ``tests/bridge/test_vllm_e2e.py::test_a_compiled_server_loads_its_model_back``."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from megarl.serving import vllm_compile_cache
from megarl.utils import hardware

AVX2 = "fpu sse4_2 avx avx2 fma"
AVX512_BF16 = AVX2 + " avx512f avx512bw avx512vl avx512_bf16"
AMX = AVX512_BF16 + " avx512_fp16 amx_tile amx_bf16"


def on_cpu(monkeypatch, flags: str) -> None:
    monkeypatch.setattr(hardware, "cpu_info", lambda: hardware.CPUInfo("test CPU", frozenset(flags.split()), 2))


def test_cpu_kind_tells_vector_widths_apart(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    kinds = {}
    for name, flags in [("avx2", AVX2), ("avx512_bf16", AVX512_BF16), ("amx", AMX)]:
        on_cpu(monkeypatch, flags)
        kinds[name] = vllm_compile_cache.cpu_kind()
    assert len(set(kinds.values())) == 3, kinds
    assert kinds["avx2"] == "avx2"  # flags that choose no vector code are not part of it

    on_cpu(monkeypatch, AVX2 + " sse4_1 popcnt")
    assert vllm_compile_cache.cpu_kind() == kinds["avx2"]

    on_cpu(monkeypatch, AVX512_BF16)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # torch and inductor limited to AVX2 on an AVX-512 CPU
    assert vllm_compile_cache.cpu_kind() not in kinds.values()


def test_the_cache_key_holds_the_cpu_kind(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    factors = vllm_compile_cache.keyed_by_cpu_kind(lambda vllm_config: ["env", "config"])
    on_cpu(monkeypatch, AVX2)
    on_avx2 = factors(None)
    on_cpu(monkeypatch, AVX512_BF16)
    on_avx512 = factors(None)
    assert on_avx2[:2] == on_avx512[:2] == ["env", "config"]
    assert on_avx2 != on_avx512


def test_a_loaded_artifact_without_finalize_loading_gets_one():
    class Piecewise:  # vLLM's own artifact (its CUDA path): keeps its method
        def finalize_loading(self, vllm_config):
            return "own"

    def loader(compiled):
        return lambda *args, **kwargs: types.SimpleNamespace(_artifacts=types.SimpleNamespace(compiled_fn=compiled))

    inductor = types.SimpleNamespace()
    loaded = vllm_compile_cache.finalizable(loader(inductor))("file")
    assert loaded._artifacts.compiled_fn.finalize_loading(None) is None

    piecewise = Piecewise()
    loaded = vllm_compile_cache.finalizable(loader(piecewise))("file")
    assert loaded._artifacts.compiled_fn.finalize_loading(None) == "own"


@pytest.mark.timeout(300)
def test_a_real_inductor_artifact_loads_with_finalize_loading(tmp_path):
    """torch 2.13 saves an inductor-compiled function as a bundled AOTAutograd artifact: what vLLM-CPU saves."""

    def f(x):
        return torch.nn.functional.silu(x) * 2 + 1

    x = torch.randn(8, 16)
    compiled = torch.compile(f, fullgraph=True, backend="inductor").aot_compile(((x,), {}))
    path = tmp_path / "artifact"
    compiled.save_compiled_function(str(path))

    # torch's own loader (a test that loaded megarl's vLLM plugin in this process has wrapped it)
    stock_load = inspect.unwrap(torch.compiler.load_compiled_function)
    with open(path, "rb") as file:
        stock = stock_load(file)
    assert not hasattr(stock._artifacts.compiled_fn, "finalize_loading")  # what vLLM 0.32's loader trips on

    with open(path, "rb") as file:
        loaded = vllm_compile_cache.finalizable(stock_load)(file)
    loaded._artifacts.compiled_fn.finalize_loading(None)
    torch.testing.assert_close(loaded(x), f(x))
