"""A loss of the user's, by config: called as the losses reference page says, with its own keyword
arguments (``actor.loss_kwargs``), through the real PPO loss on a packed micro-batch."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megarl.actor import ppo
from megarl.config.ppo import USER_LOSS_CALL, PPOActorConfig
from tests.actor.test_fused_flag import _head, _micro_batch
from tests.numerics import assert_within, gamma

REPO = Path(__file__).resolve().parents[2]


def _documented_call() -> str:
    """The call of a user's loss that ``docs/reference/losses.md`` quotes."""
    match = re.search(r"`(fn\(logprobs[^`]*\))`", (REPO / "docs/reference/losses.md").read_text())
    assert match, "docs/reference/losses.md quotes no `fn(logprobs, ...)` call of a user's loss"
    return match.group(1)


@pytest.fixture(autouse=True)
def forget_user_modules(monkeypatch):
    """The user's file is imported by its name, its folder appended to ``sys.path``: both undone after."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _loss_file(tmp_path: Path, source: str) -> str:
    (tmp_path / "userloss.py").write_text(textwrap.dedent(source))
    return f"{tmp_path / 'userloss.py'}:user_loss"


def _loss(cfg: PPOActorConfig) -> float:
    cfg.check()
    head = _head()
    return ppo.ppo_loss(head, _micro_batch(head), cfg, norm_len=64).item()


def _scaled_loss_bound(beta: float) -> float:
    """The bound of |loss(beta) - beta loss(1)| for the loss ``-beta * advantages * logprobs`` of
    :func:`_loss`'s micro-batch, in float32. A loss token's term -beta A logp w (w its behaviour weight,
    the same in both) takes 2 roundings at beta 1 (A logp, then w) and 3 at another beta (-beta A first);
    the micro-batch's T terms are summed and divided by the n loss tokens. With S = sum |A logp w|,
    loss(beta) is within gamma(T + 3) beta S / n of beta times the exact loss, loss(1) within
    gamma(T + 2) S / n of the exact loss, and beta loss(1) is exact in float64: the bound is the sum."""
    head = _head()
    mb = _micro_batch(head)
    mask = mb["loss_mask"].bool() & mb["label_mask"]
    with torch.no_grad():
        logp = head.logprobs(mb["labels"]).double()
    weight = (mb["prox_logp"].double() - mb["logprobs"].double()).exp()
    terms = (mb["advantages"].double() * logp * weight).abs()[mask].sum() / mask.sum()
    tokens = mask.numel()
    return float((gamma(tokens + 3, torch.float32) + gamma(tokens + 2, torch.float32)) * beta * terms)


def test_the_reference_page_quotes_the_call_megarl_makes(tmp_path):
    """A function declared exactly as the page says runs through the trainer's loss and receives
    every argument the page names, ``actor.loss_kwargs`` included."""
    documented = _documented_call()
    assert documented == USER_LOSS_CALL
    source = f"""
        import torch

        seen = {{}}


        def user_loss{documented[len("fn") :]}:
            seen.update(cu_seqlens=cu_seqlens, config=config, loss_kwargs=loss_kwargs)
            return -advantages * torch.exp(logprobs - anchor_logprobs) * loss_mask
    """
    cfg = PPOActorConfig(path="unused", loss=_loss_file(tmp_path, source), loss_kwargs={"beta": 0.5})
    _loss(cfg)
    seen = sys.modules["userloss"].seen
    assert seen["config"] is cfg and seen["loss_kwargs"] == {"beta": 0.5}
    assert seen["cu_seqlens"].tolist() == [0, 9, 20, 31, 40]


def test_loss_kwargs_from_the_config_reach_the_loss(tmp_path):
    source = """
        def user_loss(logprobs, anchor_logprobs, advantages, loss_mask, *, cu_seqlens, config, beta, offset=0.0):
            return -beta * advantages * logprobs + offset
    """
    loss = _loss_file(tmp_path, source)
    one = _loss(PPOActorConfig(path="unused", loss=loss, loss_kwargs={"beta": 1.0}))
    three = _loss(PPOActorConfig(path="unused", loss=loss, loss_kwargs={"beta": 3.0}))
    assert one != 0
    bound = _scaled_loss_bound(3.0)
    got, want = torch.tensor(three, dtype=torch.float64), torch.tensor(3 * one, dtype=torch.float64)
    assert_within(got, want, bound, "loss at beta 3")
    # the bound is not vacuous: 1.01 bounds away fails, 0.99 bounds away passes
    with pytest.raises(AssertionError, match="beyond their error bound"):
        assert_within(want + 1.01 * bound, want, bound, "loss at beta 3, just outside")
    assert_within(want + 0.99 * bound, want, bound, "loss at beta 3, just inside")
