"""A loss of the user's, by config: called as the losses reference page says, with its own keyword
arguments (``actor.loss_kwargs``), through the real PPO loss on a packed micro-batch."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.actor import ppo
from megarl.config.train import USER_LOSS_CALL, PPOActorConfig
from tests.actor.test_fused_flag import _head, _micro_batch

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
    assert three == pytest.approx(3 * one, rel=1e-5) and one != 0
