"""Configs of the policy loss and the advantages: the PPO actor, the critic, GRPO's normalisation.

The engine under them (Megatron, optimizer, micro-batches, LoRA) is :mod:`megarl.config.train`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.base import require
from megarl.config.train import OptimizerConfig, TrainEngineConfig
from megarl.utils.plugins import builtin_or_plugin_problem

LOSS_PRESETS: dict[str, dict] = {
    "ppo": {},
    "grpo": {"actor": {"loss_agg_mode": "seq-mean-token-mean"}},
    "dapo": {
        "actor": {"loss_agg_mode": "token-mean", "eps_clip": 0.2, "eps_clip_higher": 0.28},
        "dynamic_filter": "uniform_reward",
    },
    "dr_grpo": {
        "actor": {
            "loss_agg_mode": "seq-mean-token-sum-norm",
            "adv_norm": {"std_level": "none"},
            "dr_grpo_norm_len": "${gconfig.max_new_tokens}",
        }
    },
    "gspo": {
        "actor": {
            "importance_sampling_level": "sequence",
            "loss_agg_mode": "seq-mean-token-mean",
            "eps_clip": 3.0e-4,
            "eps_clip_higher": 4.0e-4,
        }
    },
}
"""What each built-in ``actor.loss`` sets, under the user's config (a key the config sets wins):
GRPO (DeepSeekMath) averages per sequence; DAPO clips higher (0.28), averages per token and
resamples groups without signal; Dr. GRPO divides by a constant length and not by the group's
reward std; GSPO clips a length-normalised sequence ratio in a narrow band (3e-4, 4e-4)."""


BUILTIN_LOSSES = tuple(LOSS_PRESETS)
"""``actor.loss`` names megarl implements: PPO's clipped surrogate with the settings of :data:`LOSS_PRESETS`."""


USER_LOSS_CALL = "fn(logprobs, anchor_logprobs, advantages, loss_mask, *, cu_seqlens, config, **loss_kwargs)"
"""How megarl calls an ``actor.loss`` function of your own (``megarl.actor.ppo.user_surrogate``), on
packed tokens [T]; ``loss_kwargs`` are ``actor.loss_kwargs``. The losses reference page quotes it."""


USER_LOSS_ARGUMENTS = ("logprobs", "anchor_logprobs", "advantages", "loss_mask", "cu_seqlens", "config")
"""The arguments of :data:`USER_LOSS_CALL` megarl fills in: ``actor.loss_kwargs`` cannot reuse their names."""


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
class RolloutCorrectionConfig:
    """Importance correction of the gap between the servers' sampling policy and the trainer's.

    The weight of a token is ``w = exp(prox_logp - behav_logp)``: the proximal policy (the
    trainer's weights before the update) over the behaviour policy (the servers' logprobs at
    sampling time). At ``level: sequence`` it is the geometric mean over the sequence's loss
    tokens, ``exp(mean(prox_logp - behav_logp))``, given to each of its tokens. Then, per mode:

    - ``truncate`` (TIS): the loss is weighted by ``min(w, upper)``;
    - ``mask`` (MIS): weighted by ``w``; tokens (sequences) with ``w > upper`` get zero loss;
    - ``two_sided_mask`` (IcePop): weighted by ``w``; zero loss outside ``[lower, upper]``.

    Masked tokens stay in the loss normaliser, as AReaL's ``behav_imp_weight_cap`` does (a
    stale batch does not get a larger step). This is decoupled PPO's behaviour weight, so it
    needs ``use_decoupled_loss``; ``mode: none`` keeps the plain ``behav_imp_weight_cap`` cap.
    The weights, the fractions truncated and masked and the mean ``|prox_logp - behav_logp|``
    are logged every step under ``ppo_actor/rollout_correction/``.
    """

    mode: Literal["none", "truncate", "mask", "two_sided_mask"] = "none"
    """How the weight corrects the loss (see above); ``none``: ``behav_imp_weight_cap`` decides."""
    level: Literal["token", "sequence"] = "token"
    """Per-token weights, or one per sequence (geometric mean of its token weights)."""
    upper: float = 2.0
    """Truncation threshold (``truncate``) or upper mask bound (``mask``, ``two_sided_mask``)."""
    lower: float | None = None
    """Lower mask bound of ``two_sided_mask``; None: ``1 / upper``."""

    @property
    def lower_bound(self) -> float:
        """The lower mask bound in use (0 unless ``two_sided_mask``)."""
        if self.mode != "two_sided_mask":
            return 0.0
        return 1.0 / self.upper if self.lower is None else self.lower

    def check(self) -> None:
        require(self.upper > 0, "upper", self.upper, "must be > 0")
        if self.mode == "two_sided_mask":
            require(self.upper > 1, "upper", self.upper, "the upper bound of two_sided_mask must be > 1")
            require(
                0 <= self.lower_bound < 1, "lower", self.lower, "the lower bound of two_sided_mask must be in [0, 1)"
            )
        elif self.mode in ("truncate", "mask"):
            require(self.upper >= 1, "upper", self.upper, f"a {self.mode} threshold below 1 cuts on-policy tokens")
        if self.lower is not None:
            require(
                self.mode == "two_sided_mask",
                "lower",
                self.lower,
                f"only two_sided_mask has a lower bound, mode is {self.mode!r}",
            )


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """The policy being trained, and every knob of the PPO/GRPO loss."""

    optimizer: OptimizerConfig | None = field(default_factory=OptimizerConfig)
    """Optimizer of the policy (required)."""

    loss: str = "ppo"
    """The policy loss: a built-in (``ppo``, ``grpo``, ``dapo``, ``dr_grpo``, ``gspo``; each sets
    the keys below that define it, such as ``loss_agg_mode``, unless the config sets them) or
    ``package.module.function`` (or ``path/to/file.py:function``, or ``__main__.function`` in the
    script that launches the run), a per-token surrogate called as :data:`USER_LOSS_CALL`
    ``-> loss [T]`` (or ``(loss, {name: per-token stat})``), where ``anchor_logprobs`` are the
    proximal (decoupled PPO) or behaviour logprobs and ``config`` is this config. megarl then
    applies the behaviour weight (``behav_imp_weight_cap`` / ``rollout_correction``), the KL and
    entropy terms and ``loss_agg_mode``. See ``examples/losses/``."""
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of a ``loss`` function of your own (its hyperparameters), given on every
    call; each must be a parameter of the function (unless it takes ``**kwargs``), checked when
    the config loads. A built-in loss takes none: its settings are the keys below."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per training step: the batch is split into this many mini-batches."""
    ppo_n_epochs: int = 1
    """Passes over the batch per training step."""
    temperature: float = 1.0
    """Temperature at which logprobs are computed; must equal the sampling temperature."""
    top_p: float = 1.0
    """The sampling's nucleus mass (``gconfig.top_p``; write ``${gconfig.top_p}``), replayed when
    ``replay_truncation``: logprobs, entropy and every ratio are those of the truncated,
    renormalised distribution the servers sampled from (``megarl.kernels.truncation``)."""
    top_k: int = -1
    """The sampling's top-k (``gconfig.top_k``; write ``${gconfig.top_k}``); -1: off. Replayed as ``top_p``."""
    min_p: float = 0.0
    """The sampling's min-p (``gconfig.min_p``; write ``${gconfig.min_p}``); 0: off. Replayed as ``top_p``."""
    replay_truncation: bool = True
    """Compute the trainer's logprobs under the sampling's top-k / top-p / min-p truncation (the
    three keys above must then equal ``gconfig``'s). False: the full softmax, whose ratio against
    the servers' truncated logprobs is biased (kept for comparison)."""
    adv_estimator: Literal["grpo", "gae"] = "grpo"
    """The advantage estimator ``compute_advantages`` runs (``megarl.actor.advantages.ADVANTAGE_ESTIMATORS``):
    set from ``algorithm.adv_estimator`` in an experiment config (which must agree); ``gae`` needs the
    batch's ``values`` from a critic."""
    routing_replay: Literal["none", "R2", "R3"] = "none"
    """MoE routing replay (``megarl.actor.moe_routing``, ``docs/guides/moe.md``): ``R3`` routes every
    scored token to the experts the server routed it to (needs ``rollout.return_routed_experts``);
    ``R2`` replays in the update the routing of the proximal pass (needs that pass: several
    mini-batches or epochs, or ``recompute_logprob``); ``none``: the trainer routes freely. Refused
    for a model without experts."""
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
    """Cap of the behaviour importance weight; tokens above it are dropped from the loss. None: no cap.
    A ``rollout_correction`` mode replaces it (then set it to null)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Truncated / masked / two-sided masked importance weights of the behaviour policy (TIS, MIS, IcePop)."""
    kl_ctl: float = 0.0
    """KL coefficient against the reference model; 0 disables the reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1, k2, k3)."""
    kl_in_reward: bool = False
    """Apply the KL penalty to the reward (PPO-style) instead of the loss (GRPO-style)."""
    teacher_coef: float = 1.0
    """On-policy distillation (a ``teacher`` block): each generated token's advantage gains
    ``-teacher_coef * (log pi(o_t) - log pi_teacher(o_t))``, the per-token reverse KL to the teacher (slime's
    ``opd_kl_coef``). Unused without a teacher."""
    teacher_discount: float = 0.0
    """gamma of the teacher term over the tokens that follow: 0 charges each token its own divergence (slime,
    Tinker), 1 the divergence of itself and all it leads to."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    reward_scaling: float = 1.0
    """Rewards are multiplied by this (> 0) after ``reward_bias`` is added."""
    reward_bias: float = 0.0
    """Added to rewards before scaling; any finite number, negative too."""
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
    the generation budget (max_new_tokens). None uses the padded length of the whole batch (the longest
    of the data-parallel shares', the same on every rank)."""

    def check(self) -> None:
        super().check()
        require(self.ppo_n_minibatches >= 1, "ppo_n_minibatches", self.ppo_n_minibatches, "must be >= 1")
        require(self.ppo_n_epochs >= 1, "ppo_n_epochs", self.ppo_n_epochs, "must be >= 1")
        problem = builtin_or_plugin_problem(self.loss, BUILTIN_LOSSES, "loss")
        require(problem is None, "loss", self.loss, problem)
        require(
            self.loss not in BUILTIN_LOSSES or not self.loss_kwargs,
            "loss_kwargs",
            self.loss_kwargs,
            f"the built-in loss {self.loss!r} takes its settings from the actor's own keys (eps_clip, "
            "loss_agg_mode, ...); loss_kwargs are for a loss function of your own",
        )
        reserved = sorted(set(self.loss_kwargs) & set(USER_LOSS_ARGUMENTS))
        require(
            not reserved,
            f"loss_kwargs.{reserved[0] if reserved else ''}",
            self.loss_kwargs,
            f"{reserved} are the arguments megarl passes to every loss ({USER_LOSS_CALL}); name yours otherwise",
        )
        require(self.adv_estimator in ("grpo", "gae"), "adv_estimator", self.adv_estimator, "must be grpo or gae")
        require(
            self.routing_replay in ("none", "R2", "R3"),
            "routing_replay",
            self.routing_replay,
            "must be none, R2 (replay the proximal pass's routing) or R3 (replay the servers')",
        )
        several_passes = self.ppo_n_minibatches > 1 or self.ppo_n_epochs > 1 or (self.kl_ctl > 0 and self.kl_in_reward)
        require(
            self.routing_replay != "R2" or (several_passes and (self.recompute_logprob or self.use_decoupled_loss)),
            "routing_replay",
            "R2",
            "replays the routing of the proximal pass, and this config has none (the update's first forward is "
            "the proximal policy): set ppo_n_minibatches or ppo_n_epochs > 1 with use_decoupled_loss or "
            "recompute_logprob, or use R3",
        )
        require(self.temperature > 0, "temperature", self.temperature, "must be > 0")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        require(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "must be -1 (off) or >= 1")
        require(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        require(0 < self.eps_clip < 1, "eps_clip", self.eps_clip, "must be in (0, 1)")
        if self.eps_clip_higher is not None:
            require(self.eps_clip_higher > 0, "eps_clip_higher", self.eps_clip_higher, "must be > 0")
        if self.c_clip is not None:
            require(self.c_clip > 1, "c_clip", self.c_clip, "the dual-clip constant must be > 1")
        if self.behav_imp_weight_cap is not None:
            require(self.behav_imp_weight_cap > 1, "behav_imp_weight_cap", self.behav_imp_weight_cap, "must be > 1")
        self._check_rollout_correction()
        require(self.kl_ctl >= 0, "kl_ctl", self.kl_ctl, "must be >= 0")
        require(self.entropy_coeff >= 0, "entropy_coeff", self.entropy_coeff, "must be >= 0")
        require(self.teacher_coef >= 0, "teacher_coef", self.teacher_coef, "must be >= 0")
        require(0 <= self.teacher_discount <= 1, "teacher_discount", self.teacher_discount, "must be in [0, 1]")
        require(self.reward_clip > 0, "reward_clip", self.reward_clip, "must be > 0")
        require(
            self.reward_scaling > 0,
            "reward_scaling",
            self.reward_scaling,
            "must be > 0 (0 removes every reward; a negative scale trains towards the worst answers)",
        )
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

    def _check_rollout_correction(self) -> None:
        mode = self.rollout_correction.mode
        if mode == "none":
            return
        require(
            self.use_decoupled_loss,
            "rollout_correction.mode",
            mode,
            "corrects decoupled PPO's behaviour weight: set use_decoupled_loss: true, or mode: none",
        )
        require(
            self.behav_imp_weight_cap is None,
            "behav_imp_weight_cap",
            self.behav_imp_weight_cap,
            f"rollout_correction.mode={mode!r} replaces the behaviour-weight cap: set behav_imp_weight_cap: null",
        )


ADV_ESTIMATOR_PRESETS: dict[str, dict] = {
    "grpo": {},  # actor.adv_estimator's default
    "gae": {"actor": {"adv_estimator": "gae", "adv_norm": {"mean_level": "batch", "std_level": "batch"}}},
}
"""What each ``algorithm.adv_estimator`` sets under the user's config: GAE's token advantages are
whitened over the batch (PPO's normalisation), not within a GRPO group."""


@dataclass
class AlgorithmConfig:
    """How the policy's advantages are estimated: GRPO's group baseline, or PPO's learned critic."""

    adv_estimator: Literal["grpo", "gae"] = "grpo"
    """``grpo``: each sequence's reward, normalised within its group (``actor.adv_norm``), is the
    advantage of all its tokens; no value model. ``gae``: PPO with a critic (the ``critic`` block):
    GAE(γ = ``actor.discount``, λ = ``actor.gae_lambda``) over token rewards (the outcome reward on
    the last generated token, the KL reward per token with ``actor.kl_in_reward``) and the critic's
    values, then whitened over the batch (``actor.adv_norm`` at ``batch`` level unless the config sets it)."""

    def check(self) -> None:
        pass


@dataclass
class PPOCriticConfig(TrainEngineConfig):
    """The value model of PPO (``algorithm.adv_estimator: gae``): a Megatron model with a scalar head.

    It is the actor's architecture (or ``path``'s) with a ``value_head`` (``hidden -> 1``, HF name
    ``score``, as ``AutoModelForTokenClassification(num_labels=1)``) on the last pipeline stage, in the
    actor's parallel layout, with its own optimizer, checkpoints and recover point. The head starts at
    zero unless ``path`` holds a ``score`` tensor (a critic exported by megarl).
    """

    path: str = ""
    """HF model directory or short name; empty: the actor's ``path``."""
    optimizer: OptimizerConfig | None = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """Optimizer of the critic (required); critics usually learn faster than the policy."""
    eps_clip: float | None = 0.5
    """Value clipping (AReaL's ``eps_clip`` of the critic): a value moves at most this far from the
    one it had at rollout within an update, the loss is ``0.5 * max((v - R)^2, (v_clip - R)^2)``;
    None: the plain squared error."""
    ppo_n_minibatches: int = 1
    """Critic optimizer steps per training step (the batch split into this many mini-batches)."""
    ppo_n_epochs: int = 1
    """Passes of the critic over the batch per training step."""

    def check(self) -> None:
        require(self.optimizer is not None, "optimizer", None, "the critic trains, so it needs an optimizer")
        if self.eps_clip is not None:
            require(self.eps_clip > 0, "eps_clip", self.eps_clip, "the value clip must be > 0 (null disables it)")
        require(self.ppo_n_minibatches >= 1, "ppo_n_minibatches", self.ppo_n_minibatches, "must be >= 1")
        require(self.ppo_n_epochs >= 1, "ppo_n_epochs", self.ppo_n_epochs, "must be >= 1")
