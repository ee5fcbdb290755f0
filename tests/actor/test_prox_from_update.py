"""The proximal logprobs from the update's own forward (no separate recompute pass).

With one mini-batch and one epoch, the forward of ``ppo_update`` runs on the weights
before the update, so its detached logprobs are the proximal policy's: the loss and every
gradient equal those of the path with a ``compute_logp`` pass of its own (verl's on-policy
shortcut), for decoupled PPO and for classic PPO on recomputed logprobs.
"""

from __future__ import annotations

import pytest
import torch

from megarl.actor.ppo import prox_from_update
from megarl.config.ppo import PPOActorConfig
from tests.actor.dist_utils import run_ranks
from tests.actor.workers import make_batch

LENGTHS = [7, 12, 5, 9, 11, 6, 8, 10]


@pytest.fixture(scope="module")
def batch():
    b = make_batch(LENGTHS, seed=3)
    b["rewards"] = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    b["logprobs"] = b["logprobs"] - 0.3 * torch.rand(b["logprobs"].shape)  # behaviour policy != current
    return b


@pytest.mark.multiproc
@pytest.mark.parametrize("decoupled", [True, False], ids=["decoupled", "classic"])
def test_same_loss_and_gradients_without_the_recompute_pass(tiny_model_dir, batch, decoupled):
    out = run_ranks(
        1,
        "tests.actor.workers:prox_paths",
        model_dir=str(tiny_model_dir("llama")),
        batch=batch,
        use_decoupled_loss=decoupled,
    )[0]
    assert out["needs_prox_pass"] is False
    separate, shortcut = out["separate"], out["from_update"]
    assert shortcut["loss"] == pytest.approx(separate["loss"], abs=1e-6, rel=1e-6)
    scale = separate["grads"].abs().max()
    assert scale > 1e-6  # a real gradient, not two zeros
    assert (shortcut["grads"] - separate["grads"]).abs().max() <= 1e-6 * scale
    if decoupled:  # the behaviour weight exp(prox - old) is not 1: the shortcut used the right prox
        key = "behave_imp_weight/avg"
        got = {
            name: next(v for k, v in out[name]["stats"].items() if k.endswith(key))
            for name in ("separate", "from_update")
        }
        assert got["from_update"] == pytest.approx(got["separate"], rel=1e-6)
        assert abs(got["separate"] - 1.0) > 0.05


@pytest.mark.parametrize(
    ("overrides", "shortcut"),
    [
        ({}, True),
        ({"ppo_n_minibatches": 2}, False),  # the second mini-batch's forward sees updated weights
        ({"ppo_n_epochs": 2}, False),
        ({"kl_ctl": 0.1, "kl_in_reward": True}, False),  # the KL reward needs them in compute_advantages
        ({"kl_ctl": 0.1}, True),
        ({"recompute_logprob": False, "use_decoupled_loss": False}, False),  # no proximal policy at all
    ],
)
def test_when_the_update_forward_gives_the_proximal_logprobs(overrides, shortcut):
    cfg = PPOActorConfig(**overrides)
    assert prox_from_update(cfg) is shortcut
