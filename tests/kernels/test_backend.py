"""pick_backend: which implementation one call of a fused entry point runs; the sm_90a probe's report."""

import contextlib
import logging

import pytest
import torch
from torch.utils import cpp_extension

from megarl.kernels import _cuda
from megarl.kernels.backend import pick_backend
from megarl.kernels.selfcheck import CheckResult


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
    """Forced, sm80 runs its own self-check and never the sm_90a probe."""
    monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", "sm80")
    monkeypatch.setattr(_cuda, "_sm90_available", _never)
    monkeypatch.setattr(_cuda, "_CHECKS", {})
    monkeypatch.setattr(_cuda, "_PATHS", {})
    checked = []
    monkeypatch.setattr(_cuda, "_self_check", lambda device, m: checked.append(m) or CheckResult(m, 0.0, "dz", 0.0))
    assert _cuda.use_wgmma(torch.device("cpu")) is False
    assert checked == ["sm80"]


def test_active_path_follows_the_mainloop_each_call_takes(monkeypatch):
    """Alternating MEGARL_CUDA_MAINLOOP (as a benchmark does per row): each call's path is the one
    reported, also when it comes from the cache of paths already chosen."""
    monkeypatch.setattr(_cuda, "_sm90_available", lambda index: True)
    for cache in ("_CHECKS", "_PATHS", "_ACTIVE"):
        monkeypatch.setattr(_cuda, cache, {})
    monkeypatch.setattr(_cuda, "_self_check", lambda device, m: CheckResult(m, 0.0, "dz", 0.0))
    device = torch.device("cpu")
    for mainloop in ("sm90", "sm80", "sm90", "sm80"):
        monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", mainloop)
        assert _cuda.kernel_path(device) == mainloop
        assert _cuda.active_path(device) == mainloop


def test_extra_build_flags_reach_the_jit_build(monkeypatch):
    """MEGARL_CXX_FLAGS / MEGARL_NVCC_FLAGS (e.g. a longer mbarrier time-out for a debugger) are
    split as a shell would and appended to the JIT build's flags."""
    monkeypatch.setenv("MEGARL_NVCC_FLAGS", "-DMEGARL_MBAR_TIMEOUT_NS=600000000000 -lineinfo")
    monkeypatch.setenv("MEGARL_CXX_FLAGS", "-DNAME='a b'")
    monkeypatch.delenv("MEGARL_DISABLE_CUDA_KERNELS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    built = {}
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: built.update(kwargs) or "module")
    _cuda.load_extension.cache_clear()
    try:
        assert _cuda.load_extension() == "module"
    finally:
        _cuda.load_extension.cache_clear()
    assert built["extra_cuda_cflags"][-2:] == ["-DMEGARL_MBAR_TIMEOUT_NS=600000000000", "-lineinfo"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in built["extra_cuda_cflags"]
    assert built["extra_cflags"] == ["-O3", "-DNAME=a b"]


class _FakeExtension:
    """The extension's sm90_mainloop_status, answering from a list of (available, definite, reason)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = 0

    def sm90_mainloop_status(self):
        self.calls += 1
        return self.answers.pop(0)


@pytest.fixture
def fake_probe(monkeypatch):
    def install(*answers):
        ext = _FakeExtension(*answers)
        monkeypatch.setattr(_cuda, "load_extension", lambda: ext)
        monkeypatch.setattr(_cuda, "_SM90_KNOWN", {})
        monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
        return ext

    return install


def test_a_failed_sm90_probe_is_reported_and_asked_again(fake_probe, caplog):
    ext = fake_probe((False, False, "the sm_90a probe kernel failed: out of memory"), (True, True, ""))
    with caplog.at_level(logging.WARNING, logger="megarl.kernels._cuda"):
        assert _cuda._sm90_available(0) is False
    assert "probe failed on cuda:0" in caplog.text and "out of memory" in caplog.text
    assert _cuda._sm90_available(0) is True  # not cached: the second probe ran and succeeded
    assert _cuda._sm90_available(0) is True and ext.calls == 2  # a definite answer is cached


def test_a_hopper_gpu_without_the_sm90_path_says_why_once(fake_probe, caplog):
    reason = "logprob_forward_sm90_kernel was compiled to 160 registers per thread; ... needs exactly 168"
    ext = fake_probe((False, True, reason))
    with caplog.at_level(logging.WARNING, logger="megarl.kernels._cuda"):
        assert not _cuda._sm90_available(0) and not _cuda._sm90_available(0)
    assert ext.calls == 1 and caplog.text.count("160 registers") == 1


def test_other_gpus_take_the_sm80_path_quietly(fake_probe, caplog):
    fake_probe((False, True, "the device is sm_80, not sm_90"))
    with caplog.at_level(logging.WARNING, logger="megarl.kernels._cuda"):
        assert not _cuda._sm90_available(0)
    assert caplog.text == ""
