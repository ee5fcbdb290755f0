"""Configs of the training side: the Megatron engine, its optimizer, and the PPO actor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.base import require

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
    """Overlap the distributed optimizer's parameter all-gather with forward."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "alltoall"
    """MoE token dispatcher; the CPU path forces ``allgather`` (gloo lacks what alltoall needs)."""
    moe_router_load_balancing_type: Literal["aux_loss", "none"] = "none"
    """Router load-balancing loss during RL (usually off)."""
    use_transformer_engine: bool | None = None
    """TransformerEngine layer specs; None picks TE when installed and on GPU."""

    def check(self) -> None:
        pass


@dataclass
class TrainEngineConfig:
    """A Megatron model that trains or scores: the actor, a reference model or a critic."""

    path: str = "smollm2-135m-instruct"
    """HF model directory, or a short name provisioned by ``megarl.models`` (``smollm2-135m-instruct``).
    Hub ids are not downloaded; the config check rejects a path that is neither (see
    ``megarl.config.experiment.model_path_problem``)."""
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

    def check(self) -> None:
        require(bool(self.path), "path", self.path, "a model path or short name is required")


@dataclass
class NormConfig:
    """Advantage normalisation (GRPO and its variants)."""

    mean_level: Literal["group", "batch", "none"] = "group"
    """Subtract the mean reward of the group (GRPO), of the batch, or nothing."""
    std_level: Literal["group", "batch", "none"] = "group"
    """Divide by the std of the group (GRPO), of the batch, or nothing (Dr.GRPO)."""
    mean_leave1out: bool = False
    """Leave-one-out mean (RLOO): each sample's baseline excludes itself."""
    eps: float = 1e-5
    """Added to the std before dividing."""

    def check(self) -> None:
        require(self.eps > 0, "eps", self.eps, "must be > 0")


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """The policy being trained, and every knob of the PPO/GRPO loss."""

    optimizer: OptimizerConfig | None = field(default_factory=OptimizerConfig)
    """Optimizer of the policy (required)."""

    ppo_n_minibatches: int = 1
    """Optimizer steps per training step: the batch is split into this many mini-batches."""
    ppo_n_epochs: int = 1
    """Passes over the batch per training step."""
    temperature: float = 1.0
    """Temperature at which logprobs are computed; must equal the sampling temperature."""
    eps_clip: float = 0.2
    """PPO clip range (lower side, and upper when ``eps_clip_higher`` is None)."""
    eps_clip_higher: float | None = None
    """Upper clip range (DAPO's clip-higher); None means ``eps_clip``."""
    c_clip: float | None = None
    """Dual-clip constant (> 1) bounding the loss for negative advantages; None disables it."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation: DAPO (token-mean), GRPO (seq-mean-token-mean), Dr.GRPO (seq-mean-token-sum-norm)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Per-token ratios (PPO) or GSPO's length-normalised sequence ratio."""
    recompute_logprob: bool = True
    """Recompute logprobs of the batch with the current policy before the update (proximal policy)."""
    use_decoupled_loss: bool = True
    """Decoupled PPO (AReaL): clip against the proximal policy, weight by behaviour/proximal ratio."""
    behav_imp_weight_cap: float | None = 5.0
    """Cap of the behaviour importance weight; tokens above it are dropped from the loss. None: no cap."""
    kl_ctl: float = 0.0
    """KL coefficient against the reference model; 0 disables the reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1, k2, k3)."""
    kl_in_reward: bool = False
    """Apply the KL penalty to the reward (PPO-style) instead of the loss (GRPO-style)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    reward_scaling: float = 1.0
    """Rewards are multiplied by this after ``reward_bias`` is added."""
    reward_bias: float = 0.0
    """Added to rewards before scaling."""
    reward_clip: float = 20.0
    """Rewards are clipped to [-reward_clip, reward_clip]."""
    adv_norm: NormConfig = field(default_factory=NormConfig)
    """Advantage normalisation."""
    discount: float = 1.0
    """Discount factor gamma over tokens (GAE; 1 for GRPO)."""
    gae_lambda: float = 1.0
    """GAE lambda (1 for GRPO)."""
    group_size: int = 1
    """Consecutive sequences answering one prompt (GRPO groups; equal to the rollout's n_samples)."""
    skip_zero_advantage: bool = True
    """Leave out of the forward and backward the sequences whose every loss token has advantage 0
    (a GRPO group whose samples got the same reward): their loss and gradient are exactly zero
    when no KL loss or entropy bonus applies. The loss normaliser still counts their tokens, so the
    update is the same; a batch with nothing to learn costs only the optimizer step. The per-token
    stats (entropy, ratios) then cover the sequences trained on; ``ppo_actor/skipped_seqs`` counts the rest."""
    dr_grpo_norm_len: int | None = None
    """Constant divisor of a sequence's token-loss sum for ``seq-mean-token-sum-norm`` (Dr.GRPO):
    the generation budget (max_new_tokens). None uses the padded length of the batch."""

    def check(self) -> None:
        super().check()
        require(self.ppo_n_minibatches >= 1, "ppo_n_minibatches", self.ppo_n_minibatches, "must be >= 1")
        require(self.ppo_n_epochs >= 1, "ppo_n_epochs", self.ppo_n_epochs, "must be >= 1")
        require(self.temperature > 0, "temperature", self.temperature, "must be > 0")
        require(0 < self.eps_clip < 1, "eps_clip", self.eps_clip, "must be in (0, 1)")
        if self.eps_clip_higher is not None:
            require(self.eps_clip_higher > 0, "eps_clip_higher", self.eps_clip_higher, "must be > 0")
        if self.c_clip is not None:
            require(self.c_clip > 1, "c_clip", self.c_clip, "the dual-clip constant must be > 1")
        if self.behav_imp_weight_cap is not None:
            require(self.behav_imp_weight_cap > 1, "behav_imp_weight_cap", self.behav_imp_weight_cap, "must be > 1")
        require(self.kl_ctl >= 0, "kl_ctl", self.kl_ctl, "must be >= 0")
        require(self.entropy_coeff >= 0, "entropy_coeff", self.entropy_coeff, "must be >= 0")
        require(self.reward_clip > 0, "reward_clip", self.reward_clip, "must be > 0")
        require(0 < self.discount <= 1, "discount", self.discount, "must be in (0, 1]")
        require(0 <= self.gae_lambda <= 1, "gae_lambda", self.gae_lambda, "must be in [0, 1]")
        require(self.group_size >= 1, "group_size", self.group_size, "must be >= 1")
        require(
            not (self.adv_norm.mean_leave1out and self.adv_norm.mean_level == "group" and self.group_size < 2),
            "adv_norm.mean_leave1out",
            self.adv_norm.mean_leave1out,
            f"a leave-one-out group baseline needs group_size >= 2, got group_size={self.group_size}",
        )
        if self.dr_grpo_norm_len is not None:
            require(self.dr_grpo_norm_len >= 1, "dr_grpo_norm_len", self.dr_grpo_norm_len, "must be >= 1")
        require(self.optimizer is not None, "optimizer", None, "the actor trains, so it needs an optimizer")
