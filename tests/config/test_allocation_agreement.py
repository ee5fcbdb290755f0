"""``megarl allocation`` and ``megarl config`` judge a layout by one check: every layout string the docs
and presets quote, and the ones that tripped them apart, get the same verdict from both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megarl.config import AllocationMode, ConfigError, GRPOConfig, validate_allocation
from megarl.config.allocation import AllocationError
from megarl.config.loader import load_config_values

REPO = Path(__file__).resolve().parents[2]
LAYOUT = re.compile(r"(?:vllm|sglang):[a-z0-9]+\+megatron:[a-z0-9]+")
REFUSED = ["vllm:d1p2t1+megatron:d1p1t1"]
"""Layouts the grammar reads and megarl cannot run (a pipeline inside a server)."""
UNQUOTED = ["vllm:d2t1+megatron:d1c2t1"]
"""Layouts both must take though no page quotes them (context parallel, its letter out of the usual order)."""


def quoted_layouts() -> list[str]:
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "configs").glob("*.yaml")]
    files += [*(REPO / "examples").rglob("*.md")]
    return sorted({m for f in files for m in LAYOUT.findall(f.read_text())})


def _allocation_verdict(layout: str) -> str | None:
    try:
        validate_allocation(AllocationMode.from_str(layout))
    except AllocationError as e:
        return str(e)
    return None


def _config_verdict(layout: str) -> str | None:
    """``megarl config``'s verdict on the layout alone: the cluster sized to it, the batch a multiple of
    its data-parallel size, a weight-update mode every backend takes (so nothing else is refused first)."""
    alloc = AllocationMode.from_str(layout)
    dp = alloc.train.dp if alloc.train else 1
    overrides = [
        f"allocation_mode={layout}",
        "cluster.n_nodes=1",
        f"cluster.n_gpus_per_node={alloc.world_size}",
        "cluster.device=cuda",
        f"train_dataset.batch_size={8 * dp}",
        "weight_update.mode=broadcast",
    ]
    try:
        load_config_values(overrides, GRPOConfig)
    except ConfigError as e:
        assert "allocation_mode" in str(e), f"{layout}: megarl config refused something else first: {e}"
        return str(e)
    return None


def test_the_docs_quote_layouts():
    assert len(quoted_layouts()) >= 10


@pytest.mark.parametrize("layout", quoted_layouts() + REFUSED + UNQUOTED)
def test_allocation_and_config_agree(layout):
    by_allocation, by_config = _allocation_verdict(layout), _config_verdict(layout)
    assert (by_allocation is None) == (by_config is None), (layout, by_allocation, by_config)
    if by_allocation is not None:
        assert by_allocation in by_config  # the same words, with the key named
    assert (layout in REFUSED) == (by_allocation is not None), (layout, by_allocation)
