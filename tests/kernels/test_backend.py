"""pick_backend: which implementation one call of a fused entry point runs."""

import pytest

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
