"""The model output handed to loss functions and forward hooks: hidden states + a vocab-parallel LM head.

The last pipeline stage stops before the output layer (``megarl.models.build``
builds GPTModels that return final hidden states). Losses and hooks receive an
:class:`LMHeadOutput` and ask it for token logprobs / entropies; those come from
``megarl.kernels.fused_logprobs_entropy``, which reduces each rank's vocabulary
shard to per-token statistics: the ``[T, V]`` logits never exist, on any rank. The
head's ``backend`` (from the engine's ``use_fused_kernels``) picks its CUDA or torch path.
Under context parallelism the hidden states are this rank's tokens only; the methods still take
and return per-token tensors of the whole packed stream (``megarl.actor.context_parallel``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.actor.context_parallel import ContextSplit
from megarl.kernels import Backend, Truncation, fused_logprobs_entropy
from megarl.kernels.linear_loss import TokenLossFn, fused_linear_token_loss


@dataclass
class LMHeadOutput:
    """One micro-batch's final hidden states and this rank's shard of the LM head."""

    hidden: torch.Tensor
    """``[T, H]`` final-norm hidden states of the whole packed micro-batch (same on all TP ranks)."""
    weight: torch.Tensor
    """``[V_local, H]`` this TP rank's rows of the output layer (rows past ``vocab_size`` are padding)."""
    vocab_start: int
    """Global token id of ``weight``'s first row."""
    vocab_size: int
    """Real vocabulary size (padding rows are excluded from the softmax)."""
    tp_group: object
    """Tensor-parallel group the vocabulary is split over."""
    reduce_grad_hidden: bool
    """All-reduce the hidden-state gradient over TP (False when a sequence-parallel gather does it)."""
    backend: Backend = "auto"
    """Kernel backend of the logprob / entropy (and the actor's PPO loss): see ``megarl.kernels.backend``."""
    context: ContextSplit | None = None
    """With context parallelism, ``hidden`` holds this rank's tokens only (``megarl.actor.context_parallel``):
    the methods take and return per-token tensors of the whole packed stream all the same, and run the
    head on this rank's tokens."""

    def logprobs_entropy(
        self,
        labels: torch.Tensor,
        temperature: float = 1.0,
        where: torch.Tensor | None = None,
        truncation: Truncation | None = None,
        return_outside: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """``(logprob of labels, entropy)`` per token, fp32 ``[T]``, differentiable.

        ``where`` (bool ``[T]``, the same on every TP rank): only those tokens go through the
        LM head; the others get 0 and no gradient. A loss over the generated tokens skips the
        head's work on the prompt's (TRL's ``logits_to_keep``). ``truncation``: of the sampling's
        truncated distribution (``megarl.kernels.truncation``); ``return_outside`` adds the bool
        ``[T]`` of labels that fell below their truncation threshold.
        """
        if self.context is not None:
            ctx = self.context
            mine = ctx.real.to(self.hidden.device) if where is None else ctx.local(where)
            out = self._local().logprobs_entropy(ctx.local(labels), temperature, mine, truncation, True)
            out = tuple(ctx.gather(x) for x in out)
            return out if return_outside else out[:2]
        if where is None:
            out = self._logprobs_entropy(self.hidden, labels, temperature, truncation)
            return out if return_outside else out[:2]
        rows = where.nonzero().squeeze(-1)  # [N]
        no = torch.zeros(labels.shape, dtype=torch.bool, device=self.hidden.device)
        if rows.numel() == 0:  # nothing to score: zeros that still belong to the graph
            zeros = torch.zeros(labels.shape, device=self.hidden.device) + self.zero()
            return (zeros, zeros, no) if return_outside else (zeros, zeros)
        logp, entropy, outside = self._logprobs_entropy(
            self.hidden.index_select(0, rows), labels.index_select(0, rows), temperature, truncation
        )
        zeros = torch.zeros(labels.shape, dtype=logp.dtype, device=logp.device)
        out = (zeros.index_copy(0, rows, logp), zeros.index_copy(0, rows, entropy))
        return (*out, no.index_copy(0, rows, outside)) if return_outside else out

    def zero(self) -> torch.Tensor:
        """A loss of 0 whose gradient (zeros) reaches every parameter the hidden states came from and the head's
        weight: Megatron's overlapped gradient reduction (``overlap_grad_reduce``) starts a bucket's reduction
        when each of its parameters has its gradient, and a micro-batch with nothing to score must not leave
        one out."""
        return (self.hidden.sum().float() + self.weight.sum().float()) * 0.0

    def _logprobs_entropy(self, hidden, labels, temperature, truncation=None):
        return fused_logprobs_entropy(
            hidden,
            self.weight,
            labels,
            self.tp_group,
            temperature,
            vocab_start=self.vocab_start,
            vocab_size=self.vocab_size,
            reduce_grad_hidden=self.reduce_grad_hidden,
            backend=self.backend,
            truncation=truncation,
            return_outside=True,
        )

    def token_loss(
        self,
        labels: torch.Tensor,
        token_loss_fn: TokenLossFn,
        temperature: float,
        where: torch.Tensor,
        truncation: Truncation | None = None,
        return_outside: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """The training path: ``sum_t token_loss_fn(...)`` over the rows ``where`` (bool ``[T]``) with
        the head's gradients computed in the forward (``megarl.kernels.linear_loss``: 6·T·V·H FLOPs).

        ``token_loss_fn`` gets positions among the selected rows. Returns (loss, logprob [T],
        entropy [T]); the last two detached, 0 outside ``where``. ``truncation`` and
        ``return_outside`` as :meth:`logprobs_entropy`'s.
        """
        if self.context is not None:
            return self._token_loss_over_context(labels, token_loss_fn, temperature, where, truncation, return_outside)
        rows = where.nonzero().squeeze(-1)  # [N]
        zeros = torch.zeros(labels.shape, dtype=torch.float32, device=self.hidden.device)
        no = torch.zeros(labels.shape, dtype=torch.bool, device=self.hidden.device)
        if rows.numel() == 0:  # nothing to score: a zero that still belongs to the graph
            out = (self.zero(), zeros, zeros)
            return (*out, no) if return_outside else out
        loss, logp, entropy, outside = fused_linear_token_loss(
            self.hidden.index_select(0, rows),
            self.weight,
            labels.index_select(0, rows),
            token_loss_fn,
            self.tp_group,
            temperature,
            vocab_start=self.vocab_start,
            vocab_size=self.vocab_size,
            reduce_grad_hidden=self.reduce_grad_hidden,
            backend=self.backend,
            truncation=truncation,
            return_outside=True,
        )
        out = (loss, zeros.index_copy(0, rows, logp), zeros.index_copy(0, rows, entropy))
        return (*out, no.index_copy(0, rows, outside)) if return_outside else out

    def _token_loss_over_context(self, labels, token_loss_fn, temperature, where, truncation, return_outside):
        """:meth:`token_loss` on this rank's tokens: ``token_loss_fn`` still sees positions among the
        whole stream's rows ``where`` (this rank's are scattered into them); the loss is summed over the
        context-parallel group, the per-token results gathered."""
        ctx = self.context
        rows = where.nonzero().squeeze(-1)
        position = torch.full(where.shape, -1, dtype=torch.long, device=where.device)
        position[rows] = torch.arange(rows.numel(), device=where.device)  # among the stream's rows
        mine = ctx.local(where)
        mine_position = ctx.local(position)[mine]  # this rank's rows, in order (the head's order)

        def local_fn(t0, t1, logp, entropy):
            at = mine_position[t0:t1]
            whole = (logp.new_zeros(rows.numel()).index_copy(0, at, x) for x in (logp, entropy))
            return token_loss_fn(0, rows.numel(), *whole).index_select(0, at)

        local = self._local().token_loss(ctx.local(labels), local_fn, temperature, mine, truncation, True)
        out = (ctx.sum(local[0]), *(ctx.gather(x) for x in local[1:]))
        return out if return_outside else out[:3]

    def _local(self) -> LMHeadOutput:
        """This head on this rank's tokens alone (per-token tensors of ``hidden``'s rows)."""
        return dataclasses.replace(self, context=None)

    def logprobs(
        self, labels: torch.Tensor, temperature: float = 1.0, truncation: Truncation | None = None
    ) -> torch.Tensor:
        """Logprob of ``labels`` per token, fp32 ``[T]`` (``truncation``: as :meth:`logprobs_entropy`)."""
        return self.logprobs_entropy(labels, temperature, truncation=truncation)[0]

    def candidate_logprobs(self, candidates: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``[T, K]`` logprobs of ``K`` candidate token ids per token (``candidates`` ``[T, K]``; 0 for an id
        outside the vocabulary), not differentiable: one pass of the head gives each token's softmax
        normaliser (from the logprob of its first valid candidate), and each candidate's logit is its
        row of the head times the hidden state (the row's TP rank gives it, a SUM all-reduce the rest).
        K logprob passes would cost K times the head's GEMM. Each distinct row is multiplied once, so
        memory grows with the distinct candidates (at most this rank's vocabulary), not with K (the
        probe's K is k per server)."""
        if self.context is not None:
            local = self._local().candidate_logprobs(self.context.local(candidates), temperature)
            return self.context.gather(local)
        with torch.no_grad():
            valid = (candidates >= 0) & (candidates < self.vocab_size)
            anchor = torch.where(valid, candidates, self.vocab_size).min(dim=1, keepdim=True).values
            anchor = anchor.clamp(max=self.vocab_size - 1)  # a token without a valid candidate: any id
            ids = torch.cat([anchor, candidates], dim=1)  # [T, 1 + K]
            local, mine = self._own_rows(ids)
            rows, column = torch.unique(torch.where(mine, local, 0), return_inverse=True)  # [U], [T, 1 + K]
            z = (self.hidden.float() @ self.weight[rows].float().T).gather(1, column)  # [T, 1 + K]
            z = z.div_(temperature) * mine
            if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
                dist.all_reduce(z, group=self.tp_group)
            lse = z[:, 0] - self.logprobs(anchor.squeeze(1), temperature)
            return (z[:, 1:] - lse[:, None]) * valid

    def candidate_logit_gaps(
        self, candidates: torch.Tensor, labels: torch.Tensor, where: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        """``[T, K]`` ``(z_c - z_label) / temperature`` of ``K`` candidate ids per token (``candidates`` ``[T, K]``),
        differentiable, 0 outside ``where`` (bool ``[T]``) and for an id outside the vocabulary.

        With the label's logprob from :meth:`logprobs_entropy` or :meth:`token_loss`, each candidate's logprob
        is ``logprob(label) + gap``: K + 1 dot products per token, no pass over the vocabulary (the teacher's
        top-k distillation term, :mod:`megarl.actor.teacher_loss`). A row's TP rank gives its logit, a SUM
        all-reduce the others (and the hidden state's gradient sums over the group as the head's own does);
        under context parallelism each rank its own tokens', gathered (differentiable) into the whole stream."""
        if self.context is not None:
            ctx = self.context
            local = self._local().candidate_logit_gaps(
                ctx.local(candidates), ctx.local(labels), ctx.local(where), temperature
            )
            return ctx.gather(local)
        rows = where.nonzero().squeeze(-1)
        ids = torch.cat([labels[rows, None], candidates[rows]], dim=1)  # [N, 1 + K]: the label first
        local, mine = self._own_rows(ids)
        hidden = self.hidden.index_select(0, rows)
        tp = self.tp_group is not None and dist.get_world_size(self.tp_group) > 1
        if tp and self.reduce_grad_hidden:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        z = _RowDots.apply(hidden, self.weight, torch.where(mine, local, 0), mine)
        if tp:
            from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

            z = reduce_from_tensor_model_parallel_region(z, group=self.tp_group)
        valid = (ids[:, 1:] >= 0) & (ids[:, 1:] < self.vocab_size)
        gaps = (z[:, 1:] - z[:, :1]) * (valid / temperature)
        out = torch.zeros(candidates.shape, dtype=gaps.dtype, device=gaps.device)
        return out.index_copy(0, rows, gaps) if rows.numel() else out + self.zero()

    @torch.no_grad()
    def label_and_top_k_logprobs(
        self, labels: torch.Tensor, k: int, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The logprob ``[T]`` of ``labels``, and the ``k`` most likely token ids ``[T, k]`` (int64) of each token's
        next-token distribution with their logprobs ``[T, k]`` (fp32), most likely first, from one pass of the
        head; not differentiable. Each rank takes its shard's label logit, top k and log-sum-exp, a chunk of
        tokens at a time (the chunk's logits are the only ``[tc, V_local]`` tensor); with TP they are gathered
        and merged (a teacher's top k, ``teacher.top_k``); under context parallelism each rank takes its own
        tokens', gathered into the whole stream."""
        if self.context is not None:
            ctx = self.context
            return tuple(
                ctx.gather(x) for x in self._local().label_and_top_k_logprobs(ctx.local(labels), k, temperature)
            )
        rows = self.weight.shape[0]
        real = (torch.arange(rows, device=self.weight.device) + self.vocab_start) < self.vocab_size
        step = max(1, _RowDots.ELEMENTS // rows)
        tp = self.tp_group is not None and dist.get_world_size(self.tp_group) > 1
        weight = self.weight.float()
        out_label, out_ids, out_logp = [], [], []
        for a in range(0, self.hidden.shape[0], step):
            z = (self.hidden[a : a + step].float() @ weight.T).div_(temperature)
            z.masked_fill_(~real, float("-inf"))  # padding rows of the vocabulary
            local = labels[a : a + step, None] - self.vocab_start
            inside = (local >= 0) & (local < rows)
            label = torch.where(inside, z.gather(1, local.clamp(0, rows - 1)), 0.0)  # [tc, 1]: on its row's rank
            top, ids = z.topk(min(k, rows), dim=-1)
            lse = z.logsumexp(-1, keepdim=True)
            ids = ids + self.vocab_start
            if tp:
                label, top, ids, lse = (_gathered(x, self.tp_group) for x in (label, top, ids, lse))
                label, lse = label.sum(-1, keepdim=True), lse.logsumexp(-1, keepdim=True)
                top, at = top.topk(k, dim=-1)
                ids = ids.gather(1, at)
            out_label.append((label - lse).squeeze(1))
            out_ids.append(ids)
            out_logp.append(top - lse)
        return torch.cat(out_label), torch.cat(out_ids), torch.cat(out_logp)

    def _own_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ``ids`` as rows of this rank's shard of the head, and whether this rank holds them (a real
        token of its shard: not a padding row, not an id outside the vocabulary)."""
        local = ids - self.vocab_start
        return local, (local >= 0) & (local < self.weight.shape[0]) & (ids < self.vocab_size)

    def local_logits(self) -> torch.Tensor:
        """``[T, V_local]`` logits of this rank's shard (debugging and tests; not for losses); with context
        parallelism, of this rank's tokens only."""
        return self.hidden @ self.weight.t()


def make_lm_head_output(
    model,
    hidden: torch.Tensor,
    vocab_size: int,
    tp_group,
    backend: Backend = "auto",
    context: ContextSplit | None = None,
) -> LMHeadOutput:
    """Wrap a GPTModel chunk's final hidden states ``[s, 1, H]`` (sequence-parallel shard or whole;
    ``context``: of this context-parallel rank's tokens)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    sequence_parallel = model.config.sequence_parallel
    if sequence_parallel:
        # backward reduce-scatters the hidden gradient: the TP reduction the head would do
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    weight = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )
    tp_rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
    # Float16Module hands the last stage's output back in fp32; the head runs in the weights' dtype
    hidden = hidden.to(weight.dtype)
    return LMHeadOutput(
        hidden=hidden.reshape(-1, hidden.shape[-1]),
        weight=weight,
        vocab_start=tp_rank * weight.shape[0],
        vocab_size=vocab_size,
        tp_group=tp_group,
        reduce_grad_hidden=not sequence_parallel,
        backend=backend,
        context=context,
    )


def _gathered(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` ``[n, m]`` of every rank of ``group`` side by side: ``[n, m * ranks]``."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class _RowDots(torch.autograd.Function):
    """``z[n, j] = hidden[n] · weight[rows[n, j]]`` where ``keep[n, j]``, else 0, in fp32, a chunk of tokens at a
    time: memory grows with a chunk's ``[n, K, H]`` gathered rows, which the backward gathers again instead of
    keeping them (``d weight`` is one dense fp32 ``[V_local, H]``, as the head's own)."""

    ELEMENTS = 1 << 24
    """Gathered row elements per chunk (64 MiB in fp32)."""

    @staticmethod
    def forward(ctx, hidden, weight, rows, keep):
        z = torch.zeros(rows.shape, dtype=torch.float32, device=hidden.device)
        for a, b in _RowDots.chunks(rows, hidden.shape[1]):
            z[a:b] = torch.bmm(weight[rows[a:b]].float(), hidden[a:b].float().unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(hidden, weight, rows, keep)
        return z * keep

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, rows, keep = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]  # a frozen head (LoRA) takes no d weight
        g = grad.float() * keep
        d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_hidden else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for a, b in _RowDots.chunks(rows, hidden.shape[1]):
            if want_hidden:
                d_hidden[a:b] = torch.bmm(g[a:b].unsqueeze(1), weight[rows[a:b]].float()).squeeze(1)
            if want_weight:
                spread = g[a:b, :, None] * hidden[a:b, None, :].float()  # [n, K, H]
                d_weight.index_add_(0, rows[a:b].flatten(), spread.flatten(0, 1))
        cast = (None if d is None else d.to(x.dtype) for d, x in ((d_hidden, hidden), (d_weight, weight)))
        return *cast, None, None

    @staticmethod
    def chunks(rows: torch.Tensor, width: int):
        step = max(1, _RowDots.ELEMENTS // max(1, rows.shape[1] * width))
        return ((a, min(a + step, rows.shape[0])) for a in range(0, rows.shape[0], step))
