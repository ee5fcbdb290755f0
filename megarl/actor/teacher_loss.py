"""On-policy distillation on the teacher's top k: the forward KL from the teacher to the policy over the k
tokens the teacher finds most likely at each generated position (``teacher.top_k``; NeMo-RL's distillation
loss), a term of the actor's loss weighted by ``actor.teacher_coef``.

Per generated token ``t``, with the teacher's top k ``(v_j, log q_j)`` and the policy's logprobs ``log p`` at
the sampling temperature (the policy that samples)::

    KL_t = sum_j q_j (log q_j - log p(v_j))

The head gives ``log p(v_j) = log p(y_t) + gap_j``, ``y_t`` the sampled token and ``gap_j`` the logit
difference ``(z_{v_j} - z_{y_t}) / temperature`` (:meth:`~megarl.actor.lm_head.LMHeadOutput.candidate_logit_gaps`:
k + 1 dot products per token). So::

    KL_t = sum_j q_j log q_j  -  M_t log p(y_t)  -  sum_j q_j gap_j,      M_t = sum_j q_j (the top k's mass)

The first two terms are a per-token function of the sampled token's logprob, which the PPO loss takes anyway
(:func:`token_term`: on the training path its gradient joins the loss's in the head's forward); the third is
:attr:`TeacherTopK.gap_term`, added beside. The term costs no pass of the head over the vocabulary.

The batch carries ``teacher_topk_ids`` and ``teacher_topk_logp`` (``[B, S, k]``, from the teacher's servers or
the trainer's teacher), aligned as ``teacher_logp``: position ``i`` holds the teacher's top k for token ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.actor.lm_head import LMHeadOutput

TOPK_KEYS = ("teacher_topk_ids", "teacher_topk_logp")
"""The batch's keys of the teacher's top k: token ids (int64) and their logprobs under the teacher."""


@dataclass
class TeacherTopK:
    """The teacher's top k over one micro-batch's tokens."""

    q: torch.Tensor
    """``[T, k]`` the teacher's probability of each of its top k (0 for an id outside the policy's vocabulary)."""
    gap_term: torch.Tensor | None
    """``[T]`` ``-sum_j q_j gap_j``, differentiable (0 outside the loss tokens); None in a slice of tokens."""

    def rows(self, index: torch.Tensor) -> TeacherTopK:
        """The same tokens' ``q`` at ``index``, without the gap term (a chunk of the training path)."""
        return TeacherTopK(self.q.index_select(0, index), None)


def in_batch(mb: dict) -> bool:
    """Whether the micro-batch (or batch) carries the teacher's top k."""
    return TOPK_KEYS[0] in mb


def teacher_topk(head: LMHeadOutput, mb: dict, mask: torch.Tensor, temperature: float) -> TeacherTopK | None:
    """The teacher's top k of the micro-batch ``mb`` (None without them) and the term's logit gaps on the
    tokens of ``mask``."""
    if not in_batch(mb):
        return None
    ids, logp = mb["teacher_topk_ids"].long(), mb["teacher_topk_logp"].float()
    valid = (ids >= 0) & (ids < head.vocab_size)
    q = torch.where(valid & mask[:, None], logp.exp(), torch.zeros_like(logp))
    gaps = head.candidate_logit_gaps(ids, mb["labels"], mask, temperature)
    return TeacherTopK(q, -(q * gaps).sum(-1))


def token_term(top: TeacherTopK, logp: torch.Tensor) -> torch.Tensor:
    """``[T]`` the part of ``KL_t`` that is a function of the sampled token's logprob ``logp``:
    ``sum_j q_j log q_j - M_t log p(y_t)``."""
    return torch.xlogy(top.q, top.q).sum(-1) - top.q.sum(-1) * logp
