"""Configs of the training engine: Megatron's parallel and kernel options, the optimizer, micro-batches, LoRA.

The loss and advantage keys of the PPO actor and the critic are :mod:`megarl.config.ppo`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.base import require
from megarl.models.peft_files import HF_LORA_TARGETS, lora_scale
from megarl.utils.deprecation import moved_names

DType = Literal["auto", "bfloat16", "float16", "float32"]


@dataclass
class OptimizerConfig:
    """Megatron's (distributed) optimizer and the learning-rate schedule."""

    type: Literal["adam", "sgd"] = "adam"
    """Optimizer; Adam is AdamW-style (decoupled weight decay) in Megatron-Core."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of ``lr`` for the linear and cosine decays."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warmup: constant, or linear / cosine decay to ``min_lr_ratio * lr``."""
    warmup_steps_proportion: float = 0.0
    """Fraction of all training steps spent warming the LR up linearly from 0."""
    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's DistributedOptimizer)."""
    checkpoint_layout: Literal["data_parallel", "any"] = "data_parallel"
    """What layouts the distributed optimizer's state in a checkpoint (and recover point) loads at.
    ``data_parallel``: each rank writes its own shard as it is (Megatron's ``dp_reshardable``: no
    gather, no extra memory), loadable at another data-parallel (or context-parallel) size only.
    ``any``: each parameter's state whole (``fully_reshardable``), so a run resumes at another tensor,
    pipeline, virtual pipeline or expert-parallel size too; saving gathers the state over data
    parallelism onto its first rank (through host memory, Megatron's memory-efficient variant), which
    holds about twice the model-parallel shard's fp32 weights and moments (2 x 12 bytes a parameter
    over TP x PP) while it saves, and writes them alone (``benchmarks/checkpoint_layout.py``). Without
    the distributed optimizer every checkpoint loads at any layout."""
    bf16_rounding: Literal["dithered", "nearest"] = "dithered"
    """How the bf16 (or fp16) weights the model computes with, and the servers are sent, follow
    the fp32 main parameters the optimizer updates. ``nearest`` is Megatron's own copy: weights
    loaded from a bf16 checkpoint sit exactly on the bf16 grid, so an element changes only once its
    summed updates pass half a bf16 step (~0.2-0.4% of its size); at RL learning rates most weights
    then never move and the policy learns far less per step than in fp32. ``dithered`` starts each
    main parameter a random fraction of a bf16 step away from its loaded value (the loaded model is
    unchanged), so that averaged over elements the bf16 weights move exactly as the main parameters
    do. Ignored with fp32 weights. Measured: ``benchmarks/bf16_update.py``."""

    def check(self) -> None:
        require(self.lr >= 0, "lr", self.lr, "must be >= 0")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        require(0 <= self.beta1 < 1, "beta1", self.beta1, "must be in [0, 1)")
        require(0 <= self.beta2 < 1, "beta2", self.beta2, "must be in [0, 1)")
        require(self.eps > 0, "eps", self.eps, "must be > 0")
        require(
            0 <= self.warmup_steps_proportion <= 1,
            "warmup_steps_proportion",
            self.warmup_steps_proportion,
            "must be in [0, 1]",
        )
        require(self.gradient_clipping >= 0, "gradient_clipping", self.gradient_clipping, "must be >= 0")


@dataclass
class MicroBatchSpec:
    """How a batch of variable-length trajectories is packed into micro-batches."""

    max_tokens_per_mb: int = 8192
    """Token budget of one packed micro-batch; a longer single sequence gets its own."""
    n_mbs: int = 1
    """Minimum number of micro-batches (raised as the token budget requires)."""
    share_prefix: bool | None = None
    """Pack the common prefix of rows that start alike (a GRPO group's prompt) once, each row's
    remainder attending to it: the same logprobs and gradients from fewer tokens (a 45-token
    prompt with 8 answers of 15: about 180 tokens instead of 480). Needs megarl's SDPA attention;
    None: on wherever that attention runs (without TransformerEngine: always on CPU)."""

    def check(self) -> None:
        require(self.max_tokens_per_mb >= 1, "max_tokens_per_mb", self.max_tokens_per_mb, "must be >= 1")
        require(self.n_mbs >= 1, "n_mbs", self.n_mbs, "must be >= 1")


@dataclass
class MegatronConfig:
    """Megatron-Core specifics beyond the parallel sizes (those come from allocation_mode)."""

    sequence_parallel: bool = True
    """Megatron sequence parallelism when TP > 1 (activations sharded along the sequence)."""
    recompute_granularity: Literal["none", "full", "selective"] = "none"
    """Activation recomputation."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduce with backward."""
    overlap_param_gather: bool = False
    """Dispatch the distributed optimizer's parameter all-gather asynchronously, bucket by bucket. megarl
    waits for it at the end of each step: the weight sync, checkpoints and the HF export read every
    parameter right after, so in an RL step it overlaps the buckets' all-gathers with each other, not
    with the next forward as in pretraining."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "alltoall"
    """MoE token dispatcher: ``alltoall`` sends each token to its experts' ranks only; ``allgather`` gathers
    every token on every expert-parallel rank (fewer, larger collectives). Both run on CPU (gloo) too."""
    moe_router_load_balancing_type: Literal["aux_loss", "none"] = "none"
    """Router load-balancing loss during RL (usually off): ``aux_loss`` adds Megatron's auxiliary loss,
    weighted by ``moe_aux_loss_coeff``, to the gradient of the routers."""
    moe_aux_loss_coeff: float = 1e-3
    """Weight of the load-balancing loss under ``moe_router_load_balancing_type: aux_loss`` (Qwen3-MoE's
    and Mixtral's ``router_aux_loss_coef`` is 0.001)."""
    use_transformer_engine: bool | None = None
    """TransformerEngine layer specs; None picks TE when installed and on GPU, except with LoRA
    (``lora.rank > 0``), which wraps Megatron's own linears and so always builds the local spec."""

    def check(self) -> None:
        require(self.moe_aux_loss_coeff >= 0, "moe_aux_loss_coeff", self.moe_aux_loss_coeff, "must be >= 0")


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts.linear_fc1", "experts.linear_fc2")
"""Megatron linears ``actor.lora.target_modules`` can name: attention's fused QKV and output projection,
the dense MLP's fused gate/up and down projection, and the same two in each routed expert of a MoE layer.
A fused linear named this way gets one adapter (one ``A`` shared by its HF modules)."""


@dataclass
class LoRAConfig:
    """LoRA adapters on the Megatron model (``megarl.models.lora``): the base weights are frozen and
    each targeted linear ``W`` computes ``W x + (alpha / rank) * B A dropout(x)`` (``alpha / sqrt(rank)``
    with ``use_rslora``); only ``A`` and ``B`` train.

    Unless ``init_from`` names adapters to start from, ``A`` starts as PEFT's (Kaiming-uniform) and
    ``B`` at zero, so the adapted model starts as the base model; the initial values do not depend
    on the parallel layout. See ``docs/guides/lora.md``
    for what works with adapters so far."""

    rank: int = 0
    """Adapter rank ``r``; 0 turns LoRA off (the whole model trains)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank`` (``alpha / sqrt(rank)`` with
    ``use_rslora``)."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (PEFT's ``use_rslora``): scale the adapter's output by ``alpha / sqrt(rank)``
    instead of ``alpha / rank``, so that a higher rank does not shrink its updates. An ``init_from`` adapter
    must say the same."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (not on the base linear's)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS[:4]))
    """Which linears get an adapter, by Megatron name (:data:`LORA_TARGETS`: a fused ``linear_qkv`` or
    ``linear_fc1`` gets one adapter, one ``A`` shared by its HF modules) or by HF module name
    (:data:`HF_LORA_TARGETS`: ``q_proj``, ``v_proj``, ... each get an adapter of their own, as in PEFT).
    ``linear_fc1`` / ``linear_fc2`` are the dense MLP's; a MoE model's experts are named
    ``experts.linear_fc1`` / ``experts.linear_fc2``. A linear named both ways is refused."""
    init_from: str | None = None
    """A PEFT adapter directory to start from (PEFT's, TRL's, or ``MegatronEngine.export_adapters``'): its ``r``
    ``lora_alpha`` and ``use_rslora`` must be ``rank``, ``alpha`` and ``use_rslora``, and its modules those
    ``target_modules`` names. Where
    its HF modules of one fused linear have different ``lora_A`` (any adapter trained with PEFT), name them by
    their HF names (``q_proj``, ``k_proj``, ...). None: PEFT's initialisation."""

    @property
    def enabled(self) -> bool:
        """Whether adapters are built (``rank > 0``)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """What an adapter's output is multiplied by: ``alpha / rank``, or ``alpha / sqrt(rank)`` with ``use_rslora``."""
        return lora_scale(self.rank, self.alpha, self.use_rslora)

    def check(self) -> None:
        require(self.rank >= 0, "rank", self.rank, "must be >= 0 (0 turns LoRA off)")
        require(self.alpha > 0, "alpha", self.alpha, "must be > 0")
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")
        unknown = [name for name in self.target_modules if name not in LORA_TARGETS and name not in HF_LORA_TARGETS]
        known = [*LORA_TARGETS, *HF_LORA_TARGETS]
        every_linear = f" (PEFT's all-linear: [{','.join(HF_LORA_TARGETS)}])" if "all-linear" in unknown else ""
        require(not unknown, "target_modules", unknown, f"unknown module name(s); known: {known}{every_linear}")
        both = sorted(
            {HF_LORA_TARGETS[n] for n in self.target_modules if HF_LORA_TARGETS.get(n) in self.target_modules}
        )
        require(
            not both,
            "target_modules",
            self.target_modules,
            f"names {', '.join(both)} both by its Megatron name and by HF module names: one adapter shared by its "
            "HF modules (the Megatron name) or one per HF module (the HF names), not both",
        )
        require(not self.enabled or bool(self.target_modules), "target_modules", self.target_modules, "names no module")
        require(self.init_from is None or self.enabled, "init_from", self.init_from, "needs adapters: set rank > 0")


@dataclass
class TrainEngineConfig:
    """A Megatron model that trains or scores: the actor, a reference model or a critic."""

    path: str = "smollm2-135m-instruct"
    """HF model directory, a short name provisioned by ``megarl.models`` (``smollm2-135m-instruct``), or a
    Hugging Face hub id ``org/name[@revision]``: taken from the HF cache or downloaded when the config
    loads, and replaced by its local directory (``megarl.run.prelaunch.resolve_hub_id``)."""
    dtype: DType = "auto"
    """Parameter dtype (fp32 main grads and optimizer state either way). ``auto``: bfloat16 on CUDA
    and on CPUs with native bf16 (AVX-512 BF16 / AMX), float32 elsewhere (``megarl.utils.hardware``)."""
    init_from_scratch: bool = False
    """Random initialisation instead of loading the HF weights (tests, benchmarks)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (full-layer granularity)."""
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    """Micro-batch packing."""
    optimizer: OptimizerConfig | None = None
    """Optimizer; None for a frozen model (reference)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Megatron-Core options."""
    use_fused_kernels: bool | None = None
    """Fused logprob/entropy/PPO-loss kernels (csrc); None uses them whenever they are built and on GPU."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters: with ``lora.rank > 0`` only the adapters train, the base weights stay frozen."""
    emulate_bf16: bool = False
    """With ``dtype: bfloat16`` on a CPU: keep bf16 weights, activations and gradients but compute
    each matrix product in fp32 and round it to bf16 (what native bf16 hardware does), at fp32
    speed. For checking bf16 training on CPUs without native bf16 (AVX2 only), where a bf16 matrix
    product is over 100x slower (``megarl.actor.bf16_emulation``). Not for CUDA."""

    def check(self) -> None:
        require(bool(self.path), "path", self.path, "a model path or short name is required")
        require(
            not self.emulate_bf16 or self.dtype == "bfloat16",
            "emulate_bf16",
            self.emulate_bf16,
            f"emulates bf16 arithmetic: it needs dtype=bfloat16 (got dtype={self.dtype!r})",
        )
        require(
            not (self.lora.enabled and self.megatron.use_transformer_engine),
            "megatron.use_transformer_engine",
            self.megatron.use_transformer_engine,
            "LoRA wraps Megatron's own linears, not TransformerEngine's: with lora.rank > 0 set it to "
            "null (LoRA then builds the local layer spec, TE installed or not) or false",
        )


__getattr__ = moved_names(
    __name__,
    "megarl.config.ppo",
    (
        "ADV_ESTIMATOR_PRESETS",
        "AlgorithmConfig",
        "BUILTIN_LOSSES",
        "LOSS_PRESETS",
        "NormConfig",
        "PPOActorConfig",
        "PPOCriticConfig",
        "RolloutCorrectionConfig",
        "USER_LOSS_ARGUMENTS",
        "USER_LOSS_CALL",
    ),
)
