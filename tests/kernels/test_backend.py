"""pick_backend: which implementation one call of a fused entry point runs."""

import pytest
import torch

from megarl.kernels import _cuda
from megarl.kernels.backend import pick_backend


def _never() -> bool:
    raise AssertionError("backend='torch' must not probe (or JIT-build) the CUDA extension")


def test_torch_never_probes_cuda():
    assert pick_backend("torch", _never, "") == "torch"


@pytest.mark.parametrize("applies, want", [(True, "cuda"), (False, "torch")])
def test_auto_takes_cuda_where_it_applies(applies, want):
    assert pick_backend("auto", lambda: applies, "") == want


def test_cuda_where_it_applies_or_a_clear_error():
    assert pick_backend("cuda", lambda: True, "") == "cuda"
    with pytest.raises(ValueError, match="backend='cuda' needs bf16 operands"):
        pick_backend("cuda", lambda: False, "bf16 operands")


def test_rejects_unknown_backend():
    with pytest.raises(ValueError, match="'triton'"):
        pick_backend("triton", lambda: True, "")


@pytest.mark.parametrize(
    "capability, flags",
    [
        ((9, 0), ["-gencode=arch=compute_90a,code=sm_90a"]),  # wgmma needs the arch-specific target
        ((8, 0), ["-gencode=arch=compute_80,code=sm_80"]),
        ((8, 9), ["-gencode=arch=compute_89,code=sm_89"]),
    ],
)
def test_jit_build_targets_the_device(capability, flags):
    assert _cuda.arch_flags(capability) == flags


def test_unknown_mainloop_is_named(monkeypatch):
    monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", "sm100")
    with pytest.raises(ValueError, match="MEGARL_CUDA_MAINLOOP must be one of .*'sm100'"):
        _cuda.use_wgmma(torch.device("cpu"))


def test_sm80_mainloop_needs_no_probe(monkeypatch):
    monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", "sm80")
    monkeypatch.setattr(_cuda, "load_extension", _never)
    assert _cuda.use_wgmma(torch.device("cpu")) is False
