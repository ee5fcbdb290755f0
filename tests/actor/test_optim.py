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


def test_a_resumed_schedule_follows_the_config_from_its_step(caplog):
    """Cosine over 3 steps, saved after 3; resumed with lr 5e-5 over 5 steps: step 3 of the new schedule,
    not the saved one (whose lr there is its minimum, 0), with a warning naming what changed."""
    first = build_lr_scheduler(OptimizerConfig(lr=1e-5, lr_scheduler_type="cosine"), _FakeOptimizer(), 3)
    first.step(3)
    saved = first.state_dict()
    longer = OptimizerConfig(lr=5e-5, lr_scheduler_type="cosine")
    opt = _FakeOptimizer()
    resumed = build_lr_scheduler(longer, opt, 5)
    resumed.load_state_dict(saved)
    resumed.step(0)  # sets the group's lr at the restored step count
    assert resumed.num_steps == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(_lrs(longer, 5)[3])
    assert "resumed with learning rate 5e-05, the recover point's was 1e-05" in caplog.text
    assert "resumed with total number of iterations 5, the recover point's was 3" in caplog.text


class _MegatronLike:
    """What use_fused_adam reads of Megatron's optimizer: the torch optimizer it wraps."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_fused_adam_takes_the_same_steps_as_the_per_tensor_loop():
    """use_fused_adam switches the wrapped torch AdamW to the fused kernel; three steps match the
    loop torch takes on CPU by default within fp32 rounding of the update (a few roundings per
    element: |diff| <= steps * (2 u |p| + 16 u lr), u = 2^-24)."""
    import torch

    from megarl.actor.optim import use_fused_adam
    from tests.numerics import unit_roundoff

    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 48, generator=gen), torch.randn(48, generator=gen)]
    params = {name: [torch.nn.Parameter(t.clone()) for t in start] for name in ("loop", "fused")}
    lr, steps = 1e-3, 3
    opts = {name: torch.optim.AdamW(p, lr=lr, weight_decay=0.01) for name, p in params.items()}
    assert use_fused_adam(_MegatronLike(opts["fused"])) == 1
    assert opts["fused"].param_groups[0]["fused"] is True and not opts["loop"].param_groups[0]["fused"]
    for _ in range(steps):
        grads = [torch.randn(t.shape, generator=gen) for t in start]
        for name, opt in opts.items():
            for p, g in zip(params[name], grads):
                p.grad = g.clone()
            opt.step()
    u = unit_roundoff(torch.float32)
    for loop, fused, p0 in zip(params["loop"], params["fused"], start):
        assert not torch.equal(loop.detach(), p0)  # the parameters moved
        bound = steps * (2 * u * p0.abs() + 16 * u * lr)
        assert ((loop - fused).abs() <= bound).all()


def test_fused_adam_leaves_other_optimizers_alone():
    import torch

    from megarl.actor.optim import use_fused_adam

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    assert use_fused_adam(_MegatronLike(sgd)) == 0
    assert use_fused_adam(object()) == 0  # no wrapped optimizer at all
