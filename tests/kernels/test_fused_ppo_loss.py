"""fused_ppo_loss against the actor's policy_loss (its torch path), hand-computed examples, and the
CUDA path's autograd wrapper on CPU with a stand-in extension."""

import math

import pytest
import torch

from megarl.actor import fused_ppo_loss as ppo_loss_module
from megarl.actor.fused_ppo_loss import fused_ppo_loss
from megarl.actor.losses import aggregate, policy_loss
from tests.numerics import assert_within, gamma, ppo_loss_bounds, ppo_token_relative_error


def plain_ppo_loss(logp, prox, old, adv, eps, mask, c_clip=None, cap=None, eps_high=None):
    """The actor's pure loss (megarl.actor.losses, autograd) as the independent reference."""
    out = policy_loss(
        logp,
        old,
        adv,
        mask,
        eps_clip=eps,
        eps_clip_higher=eps_high,
        c_clip=c_clip,
        proximal_logprobs=prox,
        behav_imp_weight_cap=cap,
    )
    total, count = aggregate(out.loss, out.mask, "token-mean")
    count = count.clamp(min=1)
    return total / count, out.clipped.sum() / count, out.dual_clipped.sum() / count


def hand_loss_bound(loss_tok, logp, old, prox, mask) -> torch.Tensor:
    """The float32 bound of a token-mean PPO loss (``ppo_loss_bounds``) for a hand-computed example whose
    log-probabilities are float32 roundings of exact logarithms (``math.log``): each token within its
    relative error of its exact loss ``loss_tok`` (float64), the mean adding gamma(n) sum|loss| over
    the n tokens kept, divided by their count (a power of 2 in these examples: exact)."""
    rel = ppo_token_relative_error(logp, old, prox, torch.float32, inputs_rounded=True) * mask
    count = int(mask.sum())
    magnitude = loss_tok.abs() * mask
    return ((rel * magnitude).sum() + gamma(count, torch.float32) * magnitude.sum()) / count


CLASSIC_EXACT = torch.tensor([-1.2, -0.5, 3.0, 0.8], dtype=torch.float64)
"""The classic example's per-token losses: -1.2 (clipped high), -0.5 (unclipped), min(4, 3) = 3 (dual
clip), 0.8 (clipped low)."""


def classic_example():
    """r = 1.5, 0.5, 4.0, 0.5 against old = 0; advantages 1, 1, -1, -1 (eps 0.2, dual clip 3)."""
    logp = torch.tensor([math.log(1.5), math.log(0.5), math.log(4.0), math.log(0.5)])
    return logp, torch.zeros(4), torch.tensor([1.0, 1.0, -1.0, -1.0])


def random_batch(seed, n=257):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g) * 3
    logp = old + 0.3 * torch.randn(n, generator=g)
    logp[::17] += 1.6  # large ratios, for the dual clip
    prox = old + 0.2 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.25
    return logp, old, prox, adv, mask


CONFIGS = [
    {},
    {"eps_clip_high": 0.28},
    {"dual_clip": 3.0},
    {"use_prox": True},
    {"use_prox": True, "behav_imp_weight_cap": 1.15, "dual_clip": 2.0, "eps_clip_high": 0.3},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(c) or "plain")
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_plain_torch_autograd(cfg, seed):
    cfg = dict(cfg)
    logp, old, prox, adv, mask = random_batch(seed)
    prox = prox if cfg.pop("use_prox", False) else None
    x = logp.clone().requires_grad_(True)
    loss, stats = fused_ppo_loss(x, old, adv, mask, prox_logprobs=prox, eps_clip=0.2, backend="torch", **cfg)
    loss.backward()

    y = logp.clone().requires_grad_(True)
    want, clip_frac, dual_frac = plain_ppo_loss(
        y, prox, old, adv, 0.2, mask, cfg.get("dual_clip"), cfg.get("behav_imp_weight_cap"), cfg.get("eps_clip_high")
    )
    want.backward()
    # both float32 results against the float64 reference, within the bounds derived for float32
    exact = logp.double().requires_grad_(True)
    out64 = policy_loss(
        exact,
        old.double(),
        adv.double(),
        mask,
        eps_clip=0.2,
        eps_clip_higher=cfg.get("eps_clip_high"),
        c_clip=cfg.get("dual_clip"),
        proximal_logprobs=None if prox is None else prox.double(),
        behav_imp_weight_cap=cfg.get("behav_imp_weight_cap"),
    )
    total, count = aggregate(out64.loss, out64.mask, "token-mean")
    (total / count.clamp(min=1)).backward()
    loss_tok = out64.loss.detach() * mask
    loss_bound, grad_bound = ppo_loss_bounds(loss_tok, exact.grad, logp, old, prox, mask, torch.float32)
    want64 = total.detach() / count.clamp(min=1)
    for name, got, got_grad in (("fused", loss, x.grad), ("plain", want, y.grad)):
        assert_within(got.detach(), want64, torch.tensor(loss_bound), f"{name} loss")
        assert_within(got_grad, exact.grad, grad_bound, f"{name} gradient")
    torch.testing.assert_close(stats.clip_fraction, clip_frac.float())
    torch.testing.assert_close(stats.dual_clip_fraction, dual_frac.float())
    assert stats.num_tokens.item() == mask.sum().item()
    if "dual_clip" in cfg:
        assert dual_frac > 0, "the batch should exercise the dual clip"


def test_the_derived_bounds_reject_an_error_just_above_them():
    logp, old, prox, adv, mask = random_batch(0)
    exact = logp.double().requires_grad_(True)
    out = policy_loss(exact, old.double(), adv.double(), mask, eps_clip=0.2, proximal_logprobs=prox.double())
    total, count = aggregate(out.loss, out.mask, "token-mean")
    (total / count).backward()
    loss_bound, grad_bound = ppo_loss_bounds(out.loss.detach() * mask, exact.grad, logp, old, prox, mask, torch.float32)
    want = total.detach() / count
    assert_within(want + 0.99 * loss_bound, want, torch.tensor(loss_bound), "loss just inside")
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(want + 1.01 * loss_bound, want, torch.tensor(loss_bound), "loss just outside")
    worst = int(grad_bound.argmax())
    planted = exact.grad.clone()
    planted[worst] += 1.01 * grad_bound[worst]
    with pytest.raises(AssertionError, match="1 of 257 elements"):
        assert_within(planted, exact.grad, grad_bound, "gradient just outside")
    # the hand-computed examples' bound, with the roundings of their logarithms
    logp, old, _ = classic_example()
    hand = hand_loss_bound(CLASSIC_EXACT, logp, old, None, torch.ones(4))
    want = CLASSIC_EXACT.mean()
    assert_within(want + 0.99 * hand, want, hand, "hand-computed loss just inside")
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(want + 1.01 * hand, want, hand, "hand-computed loss just outside")


def test_hand_computed_classic_ppo():
    logp, old, adv = classic_example()
    logp.requires_grad_(True)
    mask = torch.ones(4, dtype=torch.bool)
    loss, stats = fused_ppo_loss(logp, old, adv, mask, eps_clip=0.2, dual_clip=3.0)
    loss.backward()
    bound = hand_loss_bound(CLASSIC_EXACT, logp.detach(), old, None, mask)
    assert_within(loss.detach(), CLASSIC_EXACT.mean(), bound, "loss")
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.5 / 4, 0.0, 0.0]))
    assert stats.clip_fraction.item() == pytest.approx(0.5)
    assert stats.dual_clip_fraction.item() == pytest.approx(0.25)
    assert stats.importance_weight_max.item() == pytest.approx(4.0)
    assert stats.importance_weight_min.item() == pytest.approx(0.5)
    assert stats.importance_weight_mean.item() == pytest.approx(6.5 / 4)


def test_hand_computed_asymmetric_clip():
    logp = torch.tensor([math.log(1.25)], requires_grad=True)
    args = (torch.zeros(1), torch.ones(1), torch.ones(1, dtype=torch.bool))
    loss, _ = fused_ppo_loss(logp, *args, eps_clip=0.2, eps_clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25) and logp.grad.item() == pytest.approx(-1.25)
    symmetric, stats = fused_ppo_loss(logp.detach(), *args, eps_clip=0.2)
    assert symmetric.item() == pytest.approx(-1.2) and stats.clip_fraction.item() == 1.0


def test_hand_computed_behaviour_cap():
    old = torch.zeros(3)
    prox = torch.tensor([math.log(1.2), math.log(2.0), 0.0])
    logp = (prox + torch.tensor([math.log(1.1), 0.0, 0.0])).requires_grad_(True)
    adv = torch.tensor([2.0, 1.0, 5.0])
    mask = torch.tensor([True, True, False])
    loss, stats = fused_ppo_loss(logp, old, adv, mask, prox_logprobs=prox, behav_imp_weight_cap=1.5)
    loss.backward()
    # token 0: w 1.2, pg -2.2 -> -2.64; token 1: w 2 > cap, dropped but counted; token 2 masked.
    # logp[0] is the float32 sum of two rounded logarithms: its log-ratio against prox carries the
    # roundings of log(1.1) and of the sum, within u (|prox| + |logp|) since |log 1.1| < |prox|
    exact = torch.tensor([-2.64, 0.0, 0.0], dtype=torch.float64)
    bound = hand_loss_bound(exact, logp.detach(), old, prox, mask)
    assert_within(loss.detach(), exact.sum() / 2, bound, "loss")
    torch.testing.assert_close(logp.grad, torch.tensor([-2.64 / 2, 0.0, 0.0]))
    assert stats.behav_capped_fraction.item() == pytest.approx(0.5)
    assert stats.behav_weight_mean.item() == pytest.approx(1.2 / 2)


def test_denominator_shapes_and_empty_mask():
    logp, old, _, adv, mask = random_batch(3, n=24)
    x = logp.view(4, 6).clone().requires_grad_(True)
    loss, _ = fused_ppo_loss(x, old.view(4, 6), adv.view(4, 6), mask.view(4, 6), denominator=100.0)
    ref, _ = fused_ppo_loss(logp, old, adv, mask)
    torch.testing.assert_close(loss * 100.0, ref * mask.sum())
    loss.backward()
    assert x.grad.shape == (4, 6)
    empty, stats = fused_ppo_loss(logp, old, adv, torch.zeros_like(mask))
    assert empty.item() == 0.0 and stats.num_tokens.item() == 0 and stats.importance_weight_min.item() == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"eps_clip": 1.5}, "eps_clip"),
        ({"eps_clip_high": -0.1}, "eps_clip"),
        ({"dual_clip": 0.9}, "dual_clip"),
        ({"behav_imp_weight_cap": 0.0}, "behav_imp_weight_cap"),
        ({"backend": "cuda"}, "backend='cuda'"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    logp, old, _, adv, mask = random_batch(4, n=8)
    with pytest.raises(ValueError, match=match):
        fused_ppo_loss(logp, old, adv, mask, **kwargs)
    with pytest.raises(ValueError, match="advantages shape"):
        fused_ppo_loss(logp, old, adv[:3], mask)


class _StandInExtension:
    """The kernel's contract (loss_tok, grad_tok, raw stats) computed on CPU from policy_loss's autograd."""

    @staticmethod
    def ppo_loss(logp, old, prox, adv, mask, eps_low, eps_high, dual_clip, behav_cap):
        x = logp.detach().requires_grad_(True)
        with torch.enable_grad():  # autograd.Function.forward runs under no_grad
            out = policy_loss(
                x,
                old,
                adv,
                mask,
                eps_clip=eps_low,
                eps_clip_higher=eps_high,
                c_clip=dual_clip or None,
                proximal_logprobs=prox,
                behav_imp_weight_cap=behav_cap or None,
            )
            (grad_tok,) = torch.autograd.grad(out.loss.sum(), x)
        anchor = old if prox is None else prox
        return out.loss.detach(), grad_tok, ppo_loss_module._raw_stats(out, logp - anchor, mask)


@pytest.mark.parametrize("denominator", [None, 300.0])
def test_cuda_driver_matches_torch_path(monkeypatch, denominator):
    """The CUDA path's autograd wrapper (analytic per-token gradient, scaled in backward) on CPU."""
    monkeypatch.setattr(ppo_loss_module._cuda, "load_extension", lambda: _StandInExtension)
    monkeypatch.setattr(ppo_loss_module, "ppo_loss_backend", lambda backend, logprobs: backend)
    logp, old, prox, adv, mask = random_batch(5)
    kw = {"prox_logprobs": prox, "eps_clip": 0.2, "eps_clip_high": 0.28, "dual_clip": 2.0, "behav_imp_weight_cap": 1.15}
    results = []
    for backend in ("cuda", "torch"):
        x = logp.clone().requires_grad_(True)
        loss, stats = fused_ppo_loss(x, old, adv, mask, denominator=denominator, backend=backend, **kw)
        (2.0 * loss).backward()
        results.append((loss, x.grad, stats))
    (got, got_grad, got_stats), (want, want_grad, want_stats) = results
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    for field in want_stats.__dataclass_fields__:
        torch.testing.assert_close(getattr(got_stats, field), getattr(want_stats, field), msg=field)
