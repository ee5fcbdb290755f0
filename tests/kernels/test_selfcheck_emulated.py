"""The kernels' self-check (``megarl.kernels.selfcheck``) and the path choice of ``megarl.kernels._cuda``
on the host emulator: the real kernels of csrc/ behind the extension's entry points, as the
training-path tests drive them, and wrong kernels planted behind the same entry points.

A correct kernel is kept without a warning; a wrong or failing one gives way to the next path
(sm90 -> sm80 -> torch) with one warning, and the training step never sees its output; a forced
mainloop that fails is an error naming it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megarl.kernels import _cuda, logprobs_backend
from megarl.kernels.reference import VocabShard

from .test_training_path_emulated import EmulatedExtension, _case, _check, _fused, _reference

CPU = torch.device("cpu")


class DropsAPartialSm90Tile(EmulatedExtension):
    """An sm90 forward with a tail bug: it ignores a last vocab tile that is partial (so it is right
    on every shard of whole 256-row tiles)."""

    def logprob_forward(
        self, hidden, weight, labels, valid_v, vocab_start, inv_tau, num_splits, wgmma, logits=None, **kw
    ):
        if wgmma:
            valid_v = valid_v // self.TILE_VOCAB_SM90 * self.TILE_VOCAB_SM90
        return super().logprob_forward(
            hidden, weight, labels, valid_v, vocab_start, inv_tau, num_splits, wgmma, logits, **kw
        )


class Sm90RaisesACudaError(EmulatedExtension):
    def logprob_forward(self, *args, **kwargs):
        if args[7]:  # wgmma
            raise RuntimeError("logprob_forward failed: an illegal memory access was encountered")
        return super().logprob_forward(*args, **kwargs)


class SoftmaxGradOffByOnePercent(EmulatedExtension):
    """softmax_grad_stored, which both mainloops share, scaling dz by 1.01."""

    def softmax_grad_stored(self, *args, **kwargs):
        super().softmax_grad_stored(*args, **kwargs)
        args[9].mul_(1.01)  # dz


class IgnoresTheThreshold(EmulatedExtension):
    """Backward kernels that drop the truncation threshold (the full softmax's p below it)."""

    def logprob_backward_dz(self, *args, theta=None, cta_group=32):
        super().logprob_backward_dz(*args, cta_group=cta_group)

    def softmax_grad_stored(self, *args, theta=None):
        super().softmax_grad_stored(*args)


@pytest.fixture
def emulated(run_kernels, tmp_path, monkeypatch):
    """install(Extension): _cuda drives that extension on the CPU, on a device whose sm_90a probe
    said yes, with no check run yet and no mainloop forced."""

    def install(extension=EmulatedExtension):
        ext = extension(run_kernels, tmp_path)
        monkeypatch.setattr(_cuda, "load_extension", lambda: ext)
        monkeypatch.setattr(_cuda, "_num_sms", lambda index: 2)
        monkeypatch.setattr(_cuda, "_SM90_KNOWN", {0: True})
        for cache in ("_CHECKS", "_PATHS", "_ACTIVE"):
            monkeypatch.setattr(_cuda, cache, {})
        monkeypatch.delenv("MEGARL_CUDA_MAINLOOP", raising=False)
        return ext

    return install


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_correct_kernels_are_kept_without_a_warning(emulated, caplog):
    emulated()
    with caplog.at_level(logging.WARNING):
        assert _cuda.kernel_path(CPU) == "sm90"
        assert _cuda.use_wgmma(CPU)
    assert _warnings(caplog) == []
    assert _cuda.active_path(CPU) == "sm90"
    found = _cuda.verified_path(CPU)
    assert found.describe().startswith("cuda sm90 (verified: max |diff| ")
    assert found.check.ratio <= 1 and found.failed == ()


def test_a_wrong_sm90_kernel_gives_way_to_sm80_with_one_warning(emulated, caplog, monkeypatch):
    emulated(DropsAPartialSm90Tile)
    with caplog.at_level(logging.WARNING):
        assert _cuda.kernel_path(CPU) == "sm80"
        assert _cuda.kernel_path(CPU) == "sm80" and not _cuda.use_wgmma(CPU)  # settled: checked once
    (warning,) = _warnings(caplog)
    assert warning.startswith("fused kernels on cpu: cuda sm80 (verified: max |diff| ")
    # the stored logits of the dropped tile's columns stay unwritten: NaN in the emulator's buffers
    assert "sm90 failed its self-check: training logits: 4290 values are NaN" in warning
    assert _cuda.active_path(CPU) == "sm80"

    # the training step runs on the verified sm80 kernels: the planted sm90 forward never reaches it
    monkeypatch.setattr(_cuda, "operands_fit", lambda hidden, weight: True)
    T, H, rows, vocab, tau = 150, 48, 300, 291, 0.8  # a partial last 256-row tile
    hidden, weight, coefs = _case(T, H, rows, seed=1)
    labels = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(2))
    got = _fused(hidden, weight, labels, coefs, temperature=tau, vocab_size=vocab, chunk_tokens=64)
    _check(got, _reference(hidden, weight, labels, coefs, vocab, tau))


def test_a_cuda_error_in_the_check_gives_way_with_the_error_named(emulated, caplog):
    emulated(Sm90RaisesACudaError)
    with caplog.at_level(logging.WARNING):
        assert _cuda.kernel_path(CPU) == "sm80"
    (warning,) = _warnings(caplog)
    assert "sm90 failed its self-check: RuntimeError: logprob_forward failed: an illegal memory access" in warning


def test_when_every_mainloop_fails_the_torch_path_runs(emulated, caplog, monkeypatch):
    emulated(SoftmaxGradOffByOnePercent)
    monkeypatch.setattr(_cuda, "operands_fit", lambda hidden, weight: True)
    hidden, weight = torch.zeros(4, 64), torch.zeros(10, 64)
    with caplog.at_level(logging.WARNING):
        assert logprobs_backend("auto", hidden, weight) == "torch"
        with pytest.raises(ValueError, match="backend='cuda' needs .*self-check"):
            logprobs_backend("cuda", hidden, weight)
    (warning,) = _warnings(caplog)
    assert warning.startswith("fused kernels on cpu: torch (no CUDA mainloop passed its self-check: ")
    assert "sm90 failed its self-check: training dz off by up to" in warning
    assert "sm80 failed its self-check: training dz off by up to" in warning
    assert _cuda.active_path(CPU) == "torch"


def test_kernels_that_ignore_the_truncation_threshold_fail_the_check(emulated, caplog):
    emulated(IgnoresTheThreshold)
    with caplog.at_level(logging.WARNING):
        assert _cuda.kernel_path(CPU) == "torch"
    (warning,) = _warnings(caplog)
    assert "sm90 failed its self-check: truncated " in warning
    assert "sm80 failed its self-check: truncated " in warning


@pytest.mark.parametrize("forced", ["sm90", "sm80"])
def test_a_forced_mainloop_is_checked_too(emulated, monkeypatch, forced):
    emulated(DropsAPartialSm90Tile)
    monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", forced)
    if forced == "sm80":
        assert _cuda.kernel_path(CPU) == "sm80"
        return
    with pytest.raises(
        RuntimeError, match=r"MEGARL_CUDA_MAINLOOP=sm90 forces the sm90 kernels, but on cpu they failed"
    ):
        _cuda.kernel_path(CPU)


class RecordsTheCtaOrder(EmulatedExtension):
    """The real kernels, recording the CTA order each launch was given."""

    def __init__(self, *args):
        super().__init__(*args)
        self.groups: list[int] = []

    def logprob_forward(self, *args, cta_group, **kwargs):
        self.groups.append(cta_group)
        return super().logprob_forward(*args, cta_group=cta_group, **kwargs)

    def logprob_backward_dz(self, *args, cta_group, **kwargs):
        self.groups.append(cta_group)
        return super().logprob_backward_dz(*args, cta_group=cta_group, **kwargs)


@pytest.mark.parametrize("setting,launched", [(None, 32), ("1", 1), ("3", 3)])
def test_the_cta_order_comes_from_the_environment(emulated, monkeypatch, setting, launched):
    """MEGARL_CUDA_CTA_GROUP reaches every forward and backward launch; unset, the default group."""
    if setting is None:
        monkeypatch.delenv("MEGARL_CUDA_CTA_GROUP", raising=False)
    else:
        monkeypatch.setenv("MEGARL_CUDA_CTA_GROUP", setting)
    ext = emulated(RecordsTheCtaOrder)
    T, H, rows = 150, 48, 300
    hidden, weight = (x.bfloat16() for x in _case(T, H, rows, seed=5)[:2])  # as the bindings take them
    labels = torch.randint(0, rows, (T,), generator=torch.Generator().manual_seed(6))
    shard = VocabShard(start=0, valid=rows, vocab_size=rows)
    m, s, u, _ = _cuda.local_stats(hidden, weight, labels, shard, 1.0, mainloop="sm80")
    lse = m + s.log()
    zeros = torch.zeros(T)
    _cuda.grads(hidden, weight, labels, shard, 1.0, lse, zeros, torch.ones(T), zeros, 128, mainloop="sm80")
    assert len(ext.groups) == 1 + 3 and set(ext.groups) == {launched}  # the forward, 3 dz chunks of 128 rows


@pytest.mark.parametrize("setting", ["0", "-2", "eight", "1.5"])
def test_a_cta_order_that_is_no_positive_integer_is_refused_naming_the_variable(monkeypatch, setting):
    monkeypatch.setenv("MEGARL_CUDA_CTA_GROUP", setting)
    with pytest.raises(ValueError, match=f"MEGARL_CUDA_CTA_GROUP must be an integer >= 1 .* got '{setting}'"):
        _cuda.cta_group(4096)


@pytest.mark.parametrize("hidden_size,group", [(48, 32), (4096, 32), (8192, 16), (16384, 8), (1 << 20, 1)])
def test_the_default_cta_group_keeps_a_groups_hidden_rows_within_32_mib(monkeypatch, hidden_size, group):
    monkeypatch.delenv("MEGARL_CUDA_CTA_GROUP", raising=False)
    assert _cuda.cta_group(hidden_size) == group
