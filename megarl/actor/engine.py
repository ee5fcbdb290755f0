"""MegatronEngine: the TrainEngine of AReaL-lite on Megatron-Core (TP / PP / VPP / EP / ETP, DP).

Life cycle (SPMD: every trainer rank runs the same calls)::

    engine = MegatronEngine(config)                       # TrainEngineConfig / PPOActorConfig
    engine.create_process_group("megatron:d2p2t2")         # torch.distributed + megatron groups
    engine.initialize(ft_spec=total_train_steps)           # build, load HF shards, DDP, optimizer, LR
    stats = engine.train_batch(batch, loss_fn, loss_weight_fn)
    logp = engine.forward(batch, post_hook)                # forward only, [B, S]
    engine.step_lr_scheduler(); engine.set_version(v)
    engine.save(meta) / engine.load(meta); engine.destroy()

Batches are the trajectory format of ``megarl.api.trajectory`` (right-padded ``[B, S]``),
this rank's data-parallel share of the global batch. They are packed into micro-batches by
a token budget (``megarl.actor.packing``) and run through Megatron's pipeline schedules
(1F1B; interleaved with VPP). ``loss_fn(head, mb)`` and ``post_hook(head, mb)`` get an
:class:`~megarl.actor.lm_head.LMHeadOutput` (hidden states + vocab-parallel LM head: logits
are never materialised) and the micro-batch's packed tensors (``[T]`` per token, with
``labels`` / ``label_mask`` for next-token targets within each sequence).

Loss weighting: each micro-batch's loss is weighted by ``loss_weight_fn(mb)`` over the sum of
those weights across all micro-batches and data-parallel ranks, so that the update is the
gradient of one global weighted mean (token-level normalisation with token counts as weights,
sequence-level with sequence counts), whatever the packing, DP size or pipeline depth.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from megarl.actor import cpu_shim
from megarl.actor import engine_settings as settings
from megarl.actor.bf16_emulation import compute_mode
from megarl.actor.lm_head import LMHeadOutput, make_lm_head_output
from megarl.actor.optim import build_optimizer_and_schedule, finish_param_gathers, wrap_chunks
from megarl.actor.packing import MicroBatch, MicroBatchHook, unpack
from megarl.actor.parallel import ParallelState, init_parallel
from megarl.actor.schedule import plan_microbatches, run_schedule
from megarl.config.allocation import AllocationMode, TrainingAllocation
from megarl.config.train import TrainEngineConfig
from megarl.kernels import Backend, Truncation, active_path, kernel_summary, resolve_backend
from megarl.models.build import (
    build_chunks,
    describe,
    transformer_config,
)
from megarl.models.hf_io import ShardCoords, load_hf_weights, unwrap
from megarl.utils import stats_tracker
from megarl.utils.part_clock import PartClock

logger = logging.getLogger(__name__)

LossFn = Callable[[LMHeadOutput, dict], torch.Tensor]
LossWeightFn = Callable[[dict], "float | torch.Tensor"]
PostHook = Callable[[LMHeadOutput, dict], torch.Tensor]


def training_allocation(alloc: TrainingAllocation | AllocationMode | str) -> TrainingAllocation:
    """The training part of an allocation given as a string, an AllocationMode or itself."""
    if isinstance(alloc, str):
        if ":" not in alloc:
            alloc = f"megatron:{alloc}"
        alloc = AllocationMode.from_str(alloc)
    if isinstance(alloc, AllocationMode):
        if alloc.train is None:
            raise ValueError(f"allocation mode '{alloc}' has no training part ('megatron:...')")
        alloc = alloc.train
    return alloc


def _total_steps(ft_spec) -> int | None:
    if ft_spec is None or isinstance(ft_spec, int):
        return ft_spec
    return int(ft_spec.total_train_steps)


class MegatronEngine:
    """A Megatron-Core model that trains (with an optimizer) or scores (without one)."""

    def __init__(self, config: TrainEngineConfig):
        config.check()
        self.config = config
        self.parallel: ParallelState | None = None
        self.desc = None
        self.tconfig = None
        self.model: list = []
        self.optimizer = None
        self.lr_scheduler = None
        self.model_path: str | None = None
        self.kernel_backend: Backend = "auto"  # resolved from config.use_fused_kernels in initialize()
        self.share_prefix = False  # resolved from config.mb_spec.share_prefix in initialize()
        self._version = 0
        self.microbatch_hooks: list[MicroBatchHook] = []  # told each micro-batch around a chunk's forward
        self.train_clock = PartClock(not cpu_shim.cuda_available())  # train steps' seconds by part, on a CPU

    # ------------------------------------------------------------------ setup

    def create_process_group(self, alloc: TrainingAllocation | AllocationMode | str, seed: int = 1) -> ParallelState:
        """Initialise torch.distributed and Megatron's groups for ``alloc`` (its training part)."""
        self.parallel = init_parallel(training_allocation(alloc), seed=seed)
        return self.parallel

    def initialize(self, addr: str | None = None, ft_spec=None, parallel: ParallelState | None = None) -> None:
        """Build this rank's model chunks, load the HF weights, wrap for training, build the optimizer.

        ``ft_spec``: total optimizer steps for the LR schedule (an int, or an object with
        ``total_train_steps``); required when the config has an optimizer with a decaying
        or warmup schedule. ``parallel`` reuses another engine's groups (a reference model).
        """
        del addr  # single-controller address: unused by the SPMD engine
        self.parallel = parallel or self.parallel
        if self.parallel is None:
            raise ValueError("call create_process_group(allocation) (or pass parallel=) before initialize()")
        from megarl.models.provision import resolve_model_path

        self.model_path = resolve_model_path(self.config.path)
        alloc = self.parallel.alloc
        self.desc = describe(self.model_path, alloc.tp)
        self.tconfig = transformer_config(
            self.desc,
            alloc,
            sequence_parallel=self.config.megatron.sequence_parallel,
            dtype=self.dtype,
            moe_dispatcher=self.config.megatron.moe_token_dispatcher_type,
            moe_aux_loss_coeff=settings.moe_aux_loss_coeff(self.config),
            recompute=settings.recompute_granularity(self.config),
            perform_initialization=self.config.init_from_scratch,
        )
        self.kernel_backend = resolve_backend(
            self.config.use_fused_kernels, self.tconfig.params_dtype, self.tconfig.hidden_size
        )
        logger.info("fused kernels: %s", kernel_summary(self.kernel_backend))  # runs their self-check on a GPU
        self.share_prefix = settings.share_prefix(self.config, alloc.cp)
        with cpu_shim.device_mode():
            chunks = build_chunks(self.desc, self.tconfig, use_te=settings.use_transformer_engine(self.config))
            chunks = [chunk.to(cpu_shim.device()) for chunk in chunks]
            self._add_heads(chunks)
            if not self.config.init_from_scratch:
                load_hf_weights(chunks, self.desc, self.model_path, self.coords)
            if self.config.lora.enabled:
                self._add_adapters(chunks)
            self.model = self._wrap(chunks)
            if self.config.optimizer is not None:
                self._build_optimizer(_total_steps(ft_spec))
        logger.info("initialised %s (%s) under %s", self.model_path, self.desc.family.name, alloc)

    def fused_kernel_path(self) -> str:
        """What this rank's logprob kernels run: "sm90" or "sm80" (a CUDA mainloop that passed its
        self-check, ``megarl.kernels.selfcheck``) or "torch"."""
        return "torch" if self.kernel_backend == "torch" else (active_path() or "torch")

    def _add_heads(self, chunks: list) -> None:
        """Give the built chunks extra modules before the weights load (a critic's value head); none here."""

    def _add_adapters(self, chunks: list) -> None:
        """LoRA: adapters on the targeted linears, everything else frozen before the DDP wrap (so
        Megatron's DDP gives frozen weights no gradient buffer and the optimizer no state)."""
        from megarl.models import lora

        lora.add_and_load_adapters(chunks, self.config.lora, self.desc, self.coords)

    @property
    def dtype(self) -> str:
        """The parameter dtype: ``config.dtype``, with ``auto`` resolved for this machine."""
        return settings.param_dtype(self.config)

    def _compute_mode(self) -> contextlib.AbstractContextManager:
        return compute_mode(self.config.emulate_bf16)

    @property
    def coords(self) -> ShardCoords:
        """This rank's coordinates in the parameter-sharding groups."""
        p, a = self.parallel, self.parallel.alloc
        return ShardCoords(p.tp_rank, a.tp, p.ep_rank, a.ep, p.etp_rank, a.expert_tp)

    def _wrap(self, chunks: list) -> list:
        return wrap_chunks(chunks, self.tconfig, self.config)

    def _build_optimizer(self, total_steps: int | None) -> None:
        self.optimizer, self.lr_scheduler = build_optimizer_and_schedule(
            self.config.optimizer, self.model, self.tconfig, self.config.megatron.overlap_param_gather, total_steps
        )

    def destroy(self) -> None:
        """Drop the model and optimizer (process groups stay: other engines may share them)."""
        self.model, self.optimizer, self.lr_scheduler = [], None, None

    # ------------------------------------------------------------------ modes and versions

    def train(self, mode: bool = True) -> MegatronEngine:
        for chunk in self.model:
            chunk.train(mode)
        return self

    def eval(self) -> MegatronEngine:
        return self.train(False)

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    def step_lr_scheduler(self) -> None:
        """Advance the LR schedule by one optimizer step."""
        if self.lr_scheduler is None:
            raise ValueError("step_lr_scheduler() on an engine without an optimizer")
        self.lr_scheduler.step(1)

    @property
    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else 0.0

    # ------------------------------------------------------------------ micro-batches

    def microbatches(self, batch: dict) -> list[MicroBatch]:
        """Pack ``batch`` by the token budget; count and length agree across DP ranks (and fit VPP)."""
        return plan_microbatches(batch, self.config.mb_spec, self.parallel, self.share_prefix)

    def _head(self, model, output: torch.Tensor, mb: MicroBatch) -> LMHeadOutput:
        return make_lm_head_output(
            unwrap(model), output, self.desc.dims.vocab_size, self.parallel.tp_group, self.kernel_backend, mb.context
        )

    def _run_schedule(self, mbs: list[MicroBatch], extras: list, head_fn, forward_only: bool) -> list:
        return run_schedule(self.model, mbs, extras, head_fn, forward_only, self.microbatch_hooks, self.train_clock)

    # ------------------------------------------------------------------ training

    def train_batch(
        self, input_: dict | None, loss_fn: LossFn, loss_weight_fn: LossWeightFn, extra_weight: float = 0.0
    ) -> dict[str, float]:
        """One optimizer step on this rank's share of the batch; returns loss, grad_norm, lr, ...

        ``input_=None`` (on every rank) steps on zero gradients; see :meth:`forward_backward`.
        """
        stats = self.forward_backward(input_, loss_fn, loss_weight_fn, extra_weight)
        with cpu_shim.device_mode(), self.train_clock.part("optimizer"):
            update_successful, grad_norm, _ = self.optimizer.step()
            finish_param_gathers(self.model)  # the weights are the step's when this returns
        stats.update(grad_norm=float(grad_norm or 0.0), lr=self.current_lr, update_successful=float(update_successful))
        return stats

    def forward_backward(
        self, input_: dict | None, loss_fn: LossFn, loss_weight_fn: LossWeightFn, extra_weight: float = 0.0
    ) -> dict[str, float]:
        """Gradients of the weighted-mean loss over the global batch, in the DDP grad buffers (no step).

        ``extra_weight`` adds to this rank's loss weight for rows left out of ``input_`` whose loss
        is zero (they still count in the mean). ``input_=None``, which every rank must pass
        together, means no row anywhere has a nonzero loss: the gradients are zero, no pass runs.
        """
        if self.optimizer is None:
            raise ValueError("train_batch() on an engine without an optimizer (config.optimizer is None)")
        self.train()
        with self._compute_mode():
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            if input_ is None:
                return {"loss": 0.0, "loss_weight": extra_weight, "n_mbs": 0.0, "packed_tokens": 0.0}
            mbs = self.microbatches(input_)
            scales, total = self._loss_scales(mbs, loss_weight_fn, extra_weight)
            head_fn = partial(self._train_head, loss_fn)
            outputs = self.train_clock.timed("schedule", self._run_schedule)(mbs, scales, head_fn, forward_only=False)
            loss = self._weighted_loss(outputs, len(mbs))
        packed = float(sum(mb.num_tokens for mb in mbs))
        return {"loss": loss, "loss_weight": total, "n_mbs": float(len(mbs)), "packed_tokens": packed}

    def _loss_scales(
        self, mbs: list[MicroBatch], loss_weight_fn: LossWeightFn, extra_weight: float = 0.0
    ) -> tuple[list[float], float]:
        """Per-micro-batch factors turning Megatron's mean over micro-batches and DP into a global weighted
        mean. Context-parallel peers hold the same micro-batches (their weights count once) and compute the
        same loss, which Megatron's schedule multiplies by the CP size against the DP x CP gradient mean."""
        weights = [float(loss_weight_fn(mb.data)) if mb.seq_indices else 0.0 for mb in mbs]
        total = torch.tensor([sum(weights) + extra_weight], dtype=torch.float64, device=cpu_shim.device())
        if self.parallel.alloc.dp > 1:
            dist.all_reduce(total, group=self.parallel.data_group)
        total = float(total.item())
        scale = self.parallel.alloc.dp * len(mbs) / total if total > 0 else 0.0
        return [w * scale for w in weights], total

    def _train_head(self, loss_fn: LossFn, model, mb: MicroBatch, scale: float, output: torch.Tensor):
        head = self._head(model, output, mb)
        if not mb.seq_indices:  # padding-only micro-batch: keep the graph, contribute nothing
            loss = head.zero()
        else:
            loss = loss_fn(head, mb.data)
        return loss * scale, {"weighted_loss": loss.detach() * scale}

    def _weighted_loss(self, outputs: list, n_mbs: int) -> float:
        """Global weighted-mean loss, the same on every rank (summed over DP, taken from the last stage;
        context-parallel peers compute the same loss)."""
        buf = torch.zeros(1, dtype=torch.float64, device=cpu_shim.device())
        for out in outputs:  # only the last pipeline stage has outputs
            buf += out["weighted_loss"].double()
        buf /= n_mbs * self.parallel.alloc.dp  # undo the dp * n_mbs folded into the scales
        if self.parallel.alloc.dp > 1:
            dist.all_reduce(buf, group=self.parallel.data_group)
        if self.parallel.alloc.pp > 1:
            dist.all_reduce(buf, group=self.parallel.pp_group)
        return float(buf.item())

    # ------------------------------------------------------------------ forward only

    @torch.no_grad()
    def forward(self, input_: dict, post_hook: PostHook | None = None) -> torch.Tensor:
        """Per-token outputs ``[B, S, ...]`` of ``post_hook(head, mb)`` (default: next-token logprobs).

        Every rank returns the full result for its batch (sent from the last pipeline stage).
        """
        hook = post_hook or (lambda head, mb: head.logprobs(mb["labels"]) * mb["label_mask"])
        with self._compute_mode():
            mbs = self.microbatches(input_)
            head_fn = partial(self._forward_head, hook)
            outputs = self._run_schedule(mbs, [None] * len(mbs), head_fn, forward_only=True)
            batch_size, seq_dim = input_["attention_mask"].shape
            result = unpack([o["out"] for o in outputs], mbs, batch_size, seq_dim) if outputs else None
            return self._from_last_stage(result)

    @torch.no_grad()
    def compute_logp(self, data: dict, temperature: float = 1.0, truncation: Truncation | None = None) -> torch.Tensor:
        """Next-token logprobs ``[B, S]`` of ``data``'s tokens under the current weights (0 past each end);
        ``truncation``: under the sampling's top-k / top-p / min-p (``megarl.kernels.truncation``)."""

        def hook(head: LMHeadOutput, mb: dict) -> torch.Tensor:
            return head.logprobs(mb["labels"], temperature, truncation) * mb["label_mask"]

        self.eval()
        return self.forward(data, hook)

    def _forward_head(self, hook: PostHook, model, mb: MicroBatch, _extra, output: torch.Tensor):
        out = hook(self._head(model, output, mb), mb.data)
        return torch.zeros((), device=output.device), {"out": out.detach()}

    def _from_last_stage(self, result: torch.Tensor | None) -> torch.Tensor:
        if self.parallel.alloc.pp == 1:
            return result.cpu()
        box = [result.cpu() if result is not None else None]
        dist.broadcast_object_list(box, src=self.parallel.pp_last_rank, group=self.parallel.pp_group)
        return box[0]

    # ------------------------------------------------------------------ checkpoints

    def export_hf(self, path, dtype: torch.dtype | None = None) -> None:
        """Write the weights as an HF directory (collective; global rank 0 writes); with LoRA adapters, the
        merged model (each adapted weight plus ``(alpha / r) B A``; ``export_adapters()`` writes the adapters)."""
        from megarl.actor.checkpoint import export_hf

        export_hf(self, path, dtype)

    def export_adapters(self, path, dtype: torch.dtype | None = None, for_servers: bool = False) -> None:
        """Write the LoRA adapters as a PEFT adapter directory (collective; global rank 0 writes), in
        ``dtype`` (None: the adapters' own). ``for_servers``: the scale as plain ``lora_alpha / r``, the
        form every inference server reads (adapter weight sync)."""
        from megarl.actor.checkpoint import export_peft

        if not self.config.lora.enabled:
            raise ValueError("export_adapters() needs LoRA adapters (lora.rank > 0)")
        export_peft(self, path, dtype, for_servers)

    def save(self, meta) -> None:
        """Save a resumable Megatron checkpoint, or an HF export (``SaveLoadMeta.weight_format``); LoRA
        adapters and their optimizer state are in the checkpoint (the HF export is the merged model)."""
        from megarl.actor import checkpoint

        with cpu_shim.device_mode():
            checkpoint.save(self, meta)

    def load(self, meta) -> None:
        """Resume from a Megatron checkpoint written with any data-parallel size."""
        from megarl.actor import checkpoint

        with cpu_shim.device_mode():
            checkpoint.load(self, meta)


def export_stats(parallel: ParallelState) -> dict[str, float]:
    """What ``stats_tracker`` recorded since the last export, reduced over every trainer rank (a
    collective). Tensor- and context-parallel peers record the same statistics of the same tokens:
    only the first of them contributes, so a count such as ``n_tokens`` counts each token once."""
    if parallel.tp_rank != 0 or parallel.cp_rank != 0:
        stats_tracker.export(local=True)  # this rank's copies of its first peer's statistics
    return stats_tracker.export()
