"""MegatronCritic: the value model of PPO (``algorithm.adv_estimator: gae``), AReaL's ``PPOCritic``.

The actor's architecture in the actor's parallel layout (TP / PP / VPP / EP, DP), with a
scalar ``value_head`` (``hidden -> 1``) on the last pipeline stage in place of the LM head.
One training step reads::

    batch["values"] = critic.compute_values(batch)   # before the update, at next-token alignment
    actor.compute_advantages(batch)                  # GAE: advantages and batch["returns"]
    actor.ppo_update(batch)
    critic.ppo_update(batch)                         # clipped value regression on the returns
    critic.step_lr_scheduler()

``values[t]`` is the value of the prefix ending at token ``t``: the state in which token
``t + 1`` is sampled, the alignment of the actor's logprobs after ``compute_advantages``.

The value head is a plain ``torch.nn.Linear`` replicated over tensor-parallel ranks: each
rank applies it to the full (sequence-gathered) hidden states, so its gradient needs no TP
reduction and the hidden-state gradient is split back, not summed. It loads from and exports
to the HF name ``score`` (``AutoModelForTokenClassification`` with ``num_labels=1``); a
causal-LM checkpoint has none, and the head then starts at zero (values 0: the first
advantages are Monte-Carlo returns). The unused LM head of an untied model is frozen.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from megarl.actor import cpu_shim
from megarl.actor.engine import MegatronEngine, export_stats
from megarl.actor.losses import aggregate
from megarl.actor.packing import MicroBatch
from megarl.actor.ppo import ppo_loss_weight, split_minibatches
from megarl.config.ppo import PPOCriticConfig
from megarl.models.hf_io import unwrap
from megarl.models.mapping import FamilyMapping, ParamRule
from megarl.utils import stats_tracker

VALUE_HEAD_RULES = (
    ParamRule("value_head.weight", ("score.weight",), "replicated", optional=True),
    ParamRule("value_head.bias", ("score.bias",), "replicated", optional=True),
)
"""The value head's HF names (``*ForTokenClassification.score``); absent from a causal-LM checkpoint."""


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, eps_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss ``0.5 * max((v - R)^2, (v_clip - R)^2)`` and where the clip won.

    ``v_clip = old + clamp(v - old, -eps_clip, eps_clip)`` keeps the update near the values of
    the rollout (PPO's value clipping); ``eps_clip`` None gives ``0.5 * (v - R)^2``.
    """
    error = (values - returns).square()
    if eps_clip is None:
        return 0.5 * error, torch.zeros_like(error, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-eps_clip, eps_clip)
    clipped_error = (clipped_values - returns).square()
    return 0.5 * torch.maximum(error, clipped_error), clipped_error > error


def critic_loss(values: torch.Tensor, mb: dict, eps_clip: float | None) -> torch.Tensor:
    """Token-mean value loss of one packed micro-batch, with its stats (``ppo_critic/...``)."""
    mask = mb["loss_mask"].bool() & mb["label_mask"]
    old, returns = mb["values"].float(), mb["returns"].float()
    loss, clipped = value_loss(values, old, returns, eps_clip)
    stats_tracker.denominator(n_tokens=mask)
    stats_tracker.stat(
        denominator="n_tokens",
        value_loss=loss.detach(),
        clip_ratio=clipped.float(),
        values=values.detach(),
        returns=returns,
        abs_error=(values.detach() - returns).abs(),
    )
    total, weight = aggregate(loss, mask, "token-mean")
    return total / weight.clamp(min=1)


class MegatronCritic(MegatronEngine):
    """A MegatronEngine whose head is a scalar value per token."""

    def __init__(self, config: PPOCriticConfig):
        super().__init__(config)
        self.config: PPOCriticConfig = config

    def _add_heads(self, chunks: list) -> None:
        """A zero value head on the last stage; the HF mapping learns its name (``score``)."""
        dtype = self.tconfig.params_dtype
        for chunk in chunks:
            if not chunk.post_process:
                continue
            head = torch.nn.Linear(self.tconfig.hidden_size, 1, dtype=dtype, device=cpu_shim.device())
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            chunk.value_head = head
            if not chunk.share_embeddings_and_output_weights:
                chunk.output_layer.weight.requires_grad_(False)  # a critic has no use for the LM head
        self.desc = dataclasses.replace(self.desc, mapping=FamilyMapping(self.desc.mapping.rules + VALUE_HEAD_RULES))

    def _add_adapters(self, chunks: list) -> None:
        """LoRA on the critic: the adapters train, and so does the value head (new on a base model, as PEFT's
        ``modules_to_save``); the rest stays frozen."""
        super()._add_adapters(chunks)
        for chunk in chunks:
            if chunk.post_process:
                chunk.value_head.requires_grad_(True)

    def _head(self, model, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """fp32 values ``[T]`` of the micro-batch's tokens from the last stage's hidden states ``[s, 1, H]``
        (with context parallelism, of this rank's tokens, gathered into the whole stream)."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        chunk = unwrap(model)
        if chunk.config.sequence_parallel:
            # every TP rank applies the head to all tokens: backward splits the gradient, no sum
            output = gather_from_sequence_parallel_region(
                output, tensor_parallel_output_grad=False, group=self.parallel.tp_group
            )
        head = chunk.value_head
        values = head(output.to(head.weight.dtype)).reshape(-1).float()
        return values if mb.context is None else mb.context.gather(values)

    @torch.no_grad()
    def compute_values(self, data: dict) -> torch.Tensor:
        """Values ``[B, S]`` of ``data`` under the current weights (0 where no token follows)."""
        self.eval()
        return self.forward(data, lambda values, mb: values * mb["label_mask"])

    def ppo_update(self, data: dict) -> list[dict[str, float]]:
        """``ppo_n_epochs`` passes over ``ppo_n_minibatches`` mini-batches of ``data`` (with
        ``values`` and ``returns`` from ``compute_advantages``); one stats dict per optimizer step."""
        cfg = self.config
        for key in ("values", "returns"):
            if key not in data:
                raise ValueError(
                    f"critic.ppo_update needs data[{key!r}]: compute_values, then actor.compute_advantages"
                )
        loss_fn = partial(critic_loss, eps_clip=cfg.eps_clip)
        weight_fn = partial(ppo_loss_weight, mode="token-mean")
        all_stats = []
        for _ in range(cfg.ppo_n_epochs):
            for minibatch in split_minibatches(data, cfg.ppo_n_minibatches):
                with stats_tracker.scope("ppo_critic"):
                    step = self.train_batch(minibatch, loss_fn, weight_fn)
                    stats_tracker.scalar(**{k: step[k] for k in ("loss", "grad_norm", "lr", "update_successful")})
                all_stats.append(export_stats(self.parallel))
        return all_stats
