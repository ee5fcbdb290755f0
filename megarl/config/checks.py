"""The checks of a GRPO experiment that read more than one section.

Each function checks one concern across the sections it joins (batching, sampling, servers,
rollout, critic, LoRA) and raises :class:`~megarl.config.base.ConfigError` naming the key and value;
:meth:`megarl.config.experiment.GRPOConfig.check` runs them in order. A check that reads one
section only lives on that section's dataclass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.config.allocation import AllocationMode
from megarl.config.base import require
from megarl.config.rollout import MAX_SERVED_LORA_RANK
from megarl.utils.hardware import machine_memory_gib

if TYPE_CHECKING:
    from megarl.config.experiment import GRPOConfig


def check_experiment(config: GRPOConfig, alloc: AllocationMode) -> None:
    """Every cross-section check of ``config``, whose allocation is ``alloc``."""
    check_batching(config, alloc)
    check_context_parallel(config, alloc)
    check_sampling(config)
    check_servers(config, alloc)
    check_rollout(config, alloc)
    check_critic(config, alloc)
    check_lora(config)
    check_teacher(config)
    check_teacher_top_k(config)


def check_batching(config: GRPOConfig, alloc: AllocationMode) -> None:
    dp = alloc.train.dp
    bs = config.train_dataset.batch_size
    require(
        bs % dp == 0,
        "train_dataset.batch_size",
        bs,
        f"must be divisible by the trainer's data-parallel size d{dp} so every rank gets whole groups",
        related=("allocation_mode",),
    )
    _check_minibatches(bs, dp, config.actor.ppo_n_minibatches, "actor")
    n, g = config.gconfig.n_samples, config.workflow.group_size
    require(
        config.actor.group_size == config.group_size,
        "actor.group_size",
        config.actor.group_size,
        f"must equal gconfig.n_samples={n}"
        + (f" x workflow.group_size={g} = {n * g}" if g > 1 else "")
        + (f" (write `group_size: {n * g}`)" if g > 1 else " (write `group_size: ${gconfig.n_samples}`)"),
    )


def check_sampling(config: GRPOConfig) -> None:
    require(
        config.actor.temperature == config.gconfig.temperature or config.gconfig.greedy,
        "actor.temperature",
        config.actor.temperature,
        f"must equal gconfig.temperature={config.gconfig.temperature} "
        "(logprobs are scored at the sampling temperature)",
    )
    for key in ("top_p", "top_k", "min_p"):
        ours, theirs = getattr(config.actor, key), getattr(config.gconfig, key)
        require(
            ours == theirs or not config.actor.replay_truncation or config.gconfig.greedy,
            f"actor.{key}",
            ours,
            f"must equal gconfig.{key}={theirs} (write `{key}: ${{gconfig.{key}}}`): the trainer replays the "
            "sampling's truncation; or set actor.replay_truncation=false to train on the full softmax",
        )
    require(
        not (config.gconfig.greedy and config.gconfig.n_samples > 1 and config.actor.adv_norm.mean_level == "group"),
        "gconfig.greedy",
        config.gconfig.greedy,
        f"greedy training rollouts make the gconfig.n_samples={config.gconfig.n_samples} samples of a group "
        "identical, so every group-normalised advantage is 0; sample with a temperature instead",
    )


def check_servers(config: GRPOConfig, alloc: AllocationMode) -> None:
    backend = alloc.inference.backend
    require(
        backend == "vllm" or config.cluster.device != "cpu",
        "allocation_mode",
        config.allocation_mode,
        "SGLang servers need CUDA, but cluster.device is 'cpu'; use 'vllm:' on CPU",
    )
    require(
        backend == "vllm" or "sharded" not in config.weight_update.modes,
        "weight_update.mode",
        config.weight_update.mode,
        f"sharded transfer needs vLLM servers; SGLang ({config.allocation_mode}) takes 'broadcast' or 'disk'",
    )
    check_server_args(config, backend)
    context_key = "vllm.max_model_len" if backend == "vllm" else "sglang.context_length"
    context = config.context_length
    probe = config.weight_update.probe_tokens
    require(
        config.weight_update.probe_sequences == 0 or probe < context,
        "weight_update.probe_tokens",
        probe,
        f"the probe generates this many tokens after a prompt: must be below {context_key}={context}",
    )
    new = config.gconfig.max_new_tokens
    for name, data in (("train_dataset", config.train_dataset), ("valid_dataset", config.valid_dataset)):
        if data is None:
            continue
        prompt = data.max_prompt_tokens
        if prompt is None:
            why = f"must exceed gconfig.max_new_tokens={new} to leave room for a prompt"
        else:
            why = (
                f"must hold {name}.max_prompt_tokens={prompt} + gconfig.max_new_tokens={new} = "
                f"{prompt + new} tokens (the server rejects longer requests)"
            )
        require((prompt or 1) + new <= context, context_key, context, why)


def check_server_args(config: GRPOConfig, backend: str) -> None:
    """``extra_args`` do not set what megarl sets; on CPU the KV cache fits the machine and its blocks."""
    dtype_key, server = config.server_config()
    key = dtype_key.partition(".")[0]
    owned = MANAGED_SERVER_FLAGS[backend]
    clash = [a.split("=", 1)[0] for a in server.extra_args if a.split("=", 1)[0] in owned]
    require(
        not clash,
        f"{key}.extra_args",
        server.extra_args,
        f"{clash} are set by megarl from its own keys ({', '.join(owned[f] for f in clash)}): set those instead",
    )
    if backend != "vllm" or config.device != "cpu":
        return
    block = config.vllm.block_size
    require(block is None or block % 32 == 0, "vllm.block_size", block, "vLLM-CPU takes multiples of 32")
    memory = machine_memory_gib()
    per_node = -(-config.allocation.inference.dp // config.cluster.n_nodes)
    kv = config.vllm.cpu_kvcache_space_gb * per_node
    require(
        memory is None or config.cluster.n_nodes > 1 or kv < memory,
        "vllm.cpu_kvcache_space_gb",
        config.vllm.cpu_kvcache_space_gb,
        f"{per_node} server(s) x {config.vllm.cpu_kvcache_space_gb} GiB of KV cache exceed this machine's "
        f"{memory:.0f} GiB of memory",
    )


def check_rollout(config: GRPOConfig, alloc: AllocationMode) -> None:
    """The pool's queue holds a batch; group-level statistics have groups of more than one (else a warning)."""
    queue, per_rank = config.rollout.queue_size, config.train_dataset.batch_size // alloc.train.dp
    require(
        queue is None or queue >= per_rank,
        "rollout.queue_size",
        queue,
        f"must hold one batch of a trainer rank: train_dataset.batch_size / d{alloc.train.dp} = {per_rank}",
        related=("train_dataset.batch_size", "allocation_mode"),
    )
    backend = alloc.inference.backend
    require(
        not config.rollout.return_routed_experts or backend == "sglang" or config.device == "cuda",
        "rollout.return_routed_experts",
        True,
        f"{backend} servers on CPU cannot report the experts they routed to (vLLM returns them through "
        "its Model Runner V2, which needs Triton: on CUDA only); SGLang servers, or vLLM on CUDA, can",
        related=("allocation_mode", "cluster.device"),
    )
    require(
        config.actor.routing_replay != "R3" or config.rollout.return_routed_experts,
        "actor.routing_replay",
        "R3",
        "replays the servers' routes: set rollout.return_routed_experts: true (servers that report them)",
        related=("rollout.return_routed_experts",),
    )
    require(
        not (alloc.colocated and config.device == "cuda") or config.weight_update.modes == ("disk",),
        "weight_update.mode",
        config.weight_update.mode,
        "a colocated allocation on GPU puts a trainer rank and a server worker on one GPU, and NCCL cannot "
        "join two ranks on the same GPU: use weight_update.mode=disk with weight_update.disk_path on local "
        "storage (e.g. /dev/shm/megarl) and no extra_modes",
        related=("allocation_mode",),
    )
    single = config.group_size == 1
    require(
        not (single and config.dynamic_filter == "uniform_reward"),
        "dynamic_filter",
        config.dynamic_filter,
        "a group of one sample always has a uniform reward, so every group would be dropped: "
        "sample gconfig.n_samples > 1, or dynamic_filter=none",
    )
    require(
        not (single and config.algorithm.adv_estimator == "grpo" and config.actor.adv_norm.mean_level == "group"),
        "gconfig.n_samples",
        config.gconfig.n_samples,
        "a GRPO group of one sample is its own baseline, so every advantage is 0 and nothing is learned: "
        "sample > 1 per prompt, or set actor.adv_norm.mean_level=batch (or algorithm.adv_estimator=gae)",
        related=("actor.adv_norm.mean_level", "algorithm.adv_estimator"),
    )


def check_critic(config: GRPOConfig, alloc: AllocationMode) -> None:
    gae = config.algorithm.adv_estimator == "gae"
    require(
        config.actor.adv_estimator == config.algorithm.adv_estimator,
        "actor.adv_estimator",
        config.actor.adv_estimator,
        f"must be algorithm.adv_estimator ({config.algorithm.adv_estimator}), which sets it: unset it",
        related=("algorithm.adv_estimator",),
    )
    require(
        not gae or config.critic is not None,
        "critic",
        None,
        "algorithm.adv_estimator=gae learns a value model: give a critic block (e.g. `critic: {}` for the actor's model)",
    )
    require(
        gae or config.critic is None,
        "algorithm.adv_estimator",
        config.algorithm.adv_estimator,
        "a critic is configured but only algorithm.adv_estimator=gae uses one: set it to gae, or critic: null",
    )
    if config.critic is None:
        return
    _check_minibatches(config.train_dataset.batch_size, alloc.train.dp, config.critic.ppo_n_minibatches, "critic")


def _check_minibatches(batch_size: int, dp: int, n_minibatches: int, model: str) -> None:
    """Every data-parallel rank gets whole mini-batches of ``model``'s (``actor`` or ``critic``) update."""
    require(
        batch_size % (dp * n_minibatches) == 0,
        "train_dataset.batch_size",
        batch_size,
        f"must be divisible by data-parallel d{dp} x {model}.ppo_n_minibatches {n_minibatches} = {dp * n_minibatches}",
        related=("allocation_mode", f"{model}.ppo_n_minibatches"),
    )


def check_lora(config: GRPOConfig) -> None:
    """LoRA adapters run on the actor and the critic (not on a frozen ref model); adapter sync serves what servers
    can load."""
    if config.adapter_sync:
        experts = [m for m in config.actor.lora.target_modules if m.startswith("experts.")]
        require(
            not experts,
            "weight_update.lora",
            config.weight_update.lora,
            f"adapters on expert linears ({', '.join(experts)}) have no PEFT form the servers load yet: "
            "use 'merged' (docs/guides/lora.md)",
        )
        require(
            config.actor.lora.rank <= MAX_SERVED_LORA_RANK,
            "actor.lora.rank",
            config.actor.lora.rank,
            f"adapter sync: vLLM serves LoRA ranks up to {MAX_SERVED_LORA_RANK}; use 'merged' above that",
        )
    if config.ref is not None:
        require(
            not config.ref.lora.enabled,
            "ref.lora.rank",
            config.ref.lora.rank,
            "the reference model is frozen: adapters would not train (a LoRA actor without a ref block scores its "
            "reference with its own model and initial adapters: docs/concepts/algorithms.md): set rank 0",
        )


MANAGED_SERVER_FLAGS = {
    "vllm": {
        "--model": "actor.path",
        "--host": "the launcher",
        "--port": "the launcher",
        "--dtype": "vllm.dtype",
        "--max-model-len": "vllm.max_model_len",
        "--max-num-seqs": "vllm.max_num_seqs",
        "--seed": "vllm.seed",
        "--tensor-parallel-size": "allocation_mode",
        "--block-size": "vllm.block_size",
        "--gpu-memory-utilization": "vllm.gpu_memory_utilization",
        "--api-key": "the launcher",
        "--enable-lora": "weight_update.lora",
        "--max-lora-rank": "actor.lora.rank",
    },
    "sglang": {
        "--model-path": "actor.path",
        "--host": "the launcher",
        "--port": "the launcher",
        "--dtype": "sglang.dtype",
        "--context-length": "sglang.context_length",
        "--tp-size": "allocation_mode",
        "--random-seed": "sglang.random_seed",
        "--mem-fraction-static": "sglang.mem_fraction_static",
        "--enable-lora": "weight_update.lora",
        "--max-lora-rank": "actor.lora.rank",
    },
}
"""Server flags megarl sets from a config key (flag -> key): ``extra_args`` may not repeat them."""


def check_context_parallel(config: GRPOConfig, alloc: AllocationMode) -> None:
    """What context parallelism (``c`` > 1: each sequence split over ranks) cannot take yet: a prompt
    packed once for its group (its rows' branches attend to a prefix held in chunks elsewhere)."""
    cp = alloc.train.cp
    if cp == 1:
        return
    for key, engine in (("actor", config.actor), ("ref", config.ref), ("critic", config.critic)):
        if engine is not None:
            require(
                not engine.mb_spec.share_prefix,
                f"{key}.mb_spec.share_prefix",
                True,
                f"packs a group's prompt once, which context parallel c{cp} cannot split: set it to null or false",
                related=("allocation_mode",),
            )


NO_REWARD_FN = "megarl.reward.base.no_reward_fn"
"""Pure on-policy distillation's reward: 0 for every completion."""


def check_teacher(config: GRPOConfig) -> None:
    """A teacher block is used only through ``actor.teacher_coef``; without a reward, it is the whole signal."""
    if config.reward_fn == NO_REWARD_FN:
        require(
            config.teacher is not None,
            "reward_fn",
            config.reward_fn,
            "scores every completion 0: without a teacher block nothing would be learned",
            related=("teacher",),
        )
        require(
            config.dynamic_filter != "uniform_reward",
            "dynamic_filter",
            config.dynamic_filter,
            f"drops groups whose rewards are all equal, and reward_fn={NO_REWARD_FN} makes every group so: no "
            "batch would ever fill (set dynamic_filter: none)",
            related=("reward_fn",),
        )
        require(
            config.valid_dataset is None or config.eval_workflow is not None,
            "eval_workflow",
            None,
            f"the evaluation would score with reward_fn={NO_REWARD_FN}, 0 for every answer: give eval_workflow "
            "a reward of the task (e.g. {type: rlvr, kwargs: {reward_fn: ...}}) or drop valid_dataset",
            related=("reward_fn", "valid_dataset"),
        )
    if config.teacher is None:
        return
    require(
        config.actor.teacher_coef > 0,
        "actor.teacher_coef",
        config.actor.teacher_coef,
        "must be > 0 with a teacher block: the teacher would score every trajectory for nothing "
        "(remove the teacher block, or give its term a weight)",
        related=("teacher",),
    )


def check_teacher_top_k(config: GRPOConfig) -> None:
    """The teacher's top-k term (``teacher.top_k``) is a term of the actor's loss over the full softmax: not beside
    a replayed truncation (the loss's logprobs are then the truncated distribution's); its discount is the
    reverse-KL advantage's, which it replaces."""
    if config.teacher is None or config.teacher.top_k == 0:
        return
    top_k = ("teacher.top_k",)
    actor = config.actor
    truncation = {key: getattr(actor, key) for key in ("top_k", "top_p", "min_p")}
    truncated = actor.top_k > 0 or actor.top_p < 1 or actor.min_p > 0
    require(
        not (actor.replay_truncation and truncated),
        "actor.replay_truncation",
        True,
        f"replays the sampling's truncation ({truncation}), under which the loss's logprobs are of the "
        "truncated distribution, while the teacher's top-k term compares full distributions: set "
        "actor.replay_truncation: false, or teacher.top_k: 0",
        related=top_k,
    )
    require(
        actor.teacher_discount == 0,
        "actor.teacher_discount",
        actor.teacher_discount,
        "discounts the reverse-KL term of the advantages, which the teacher's top-k term of the loss replaces: "
        "set it to 0, or teacher.top_k: 0",
        related=top_k,
    )
