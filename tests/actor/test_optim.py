"""LR schedules: warmup from 0, then constant, linear or cosine decay to min_lr_ratio * lr."""

from __future__ import annotations

import math

import pytest

from megarl.actor.optim import build_lr_scheduler
from megarl.config.train import OptimizerConfig


class _FakeOptimizer:
    def __init__(self):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def _lrs(cfg: OptimizerConfig, total: int) -> list[float]:
    opt = _FakeOptimizer()
    sched = build_lr_scheduler(cfg, opt, total)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(total):
        sched.step(1)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_constant_schedule():
    assert _lrs(OptimizerConfig(lr=1e-3), 4) == pytest.approx([1e-3] * 5)


def test_warmup_then_linear_decay():
    cfg = OptimizerConfig(lr=1.0, min_lr_ratio=0.1, lr_scheduler_type="linear", warmup_steps_proportion=0.2)
    # 10 steps: warmup 2 (0 -> 1), then linear from 1 at step 2 to 0.1 at step 10
    want = [0.0, 0.5, 1.0] + [0.1 + 0.9 * (1 - (s - 2) / 8) for s in range(3, 11)]
    assert _lrs(cfg, 10) == pytest.approx(want)


def test_warmup_then_cosine_decay():
    cfg = OptimizerConfig(lr=2.0, min_lr_ratio=0.0, lr_scheduler_type="cosine", warmup_steps_proportion=0.25)
    want = [0.0, 2.0] + [0.5 * (1 + math.cos(math.pi * (s - 1) / 3)) * 2.0 for s in range(2, 5)]
    assert _lrs(cfg, 4) == pytest.approx(want)


def test_schedule_needs_positive_total_steps():
    with pytest.raises(ValueError, match="total_steps must be >= 1"):
        build_lr_scheduler(OptimizerConfig(), _FakeOptimizer(), 0)
