"""The KL reference of a LoRA actor, scored by the actor's own model: no second copy of the weights."""

from __future__ import annotations

import torch

from megarl.actor.engine import MegatronEngine
from megarl.kernels import Truncation
from megarl.models import lora


class AdapterReference:
    """The actor's initial weights as the KL reference (``actor.kl_ctl > 0`` without a ``ref`` config) of a
    LoRA actor, without a reference model: the actor's model scores a batch with its adapters set back to
    those it started from (``actor.lora.init_from``'s, else PEFT's initial ones, whose ``B = 0``: the base
    model), and its own adapters are restored, bit for bit, after. A reference model would hold a second
    copy of the base weights; verl likewise scores the reference of a LoRA actor with the actor, its
    adapters disabled.

    Args:
        actor: The LoRA actor (initialized).
    """

    def __init__(self, actor: MegatronEngine):
        if not actor.config.lora.enabled:
            raise ValueError("AdapterReference needs a LoRA actor (actor.lora.rank > 0)")
        self.actor = actor
        self.initial = lora.initial_values(actor.model, actor.coords, actor.config.lora, actor.desc)

    def compute_logp(self, data: dict, temperature: float = 1.0, truncation: Truncation | None = None) -> torch.Tensor:
        """The reference's next-token logprobs ``[B, S]`` of ``data`` (as :meth:`MegatronEngine.compute_logp`;
        a MoE actor routes them itself, as a reference model does)."""
        with lora.holding(self.initial):  # the step's parameter all-gathers have landed (train_batch)
            return MegatronEngine.compute_logp(self.actor, data, temperature, truncation)
