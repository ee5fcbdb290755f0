"""Configs of the rollout side: sampling, the inference client and pool, the servers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.api.io_struct import GenerationHyperparameters  # noqa: F401 - the schema of `gconfig`, defined with the requests
from megarl.config.base import require
from megarl.utils.plugins import builtin_or_plugin_problem


@dataclass
class InferenceEngineConfig:
    """The rollout client and pool: where the servers are and how hard to drive them."""

    server_addrs: list[str] = field(default_factory=list)
    """``host:port`` of every inference server. Empty: read ``server_addrs_env``."""
    server_addrs_env: str = "MEGARL_LLM_SERVER_ADDRS"
    """Environment variable (comma-separated ``host:port``) set by the launchers; when it is unset or empty,
    AReaL's ``AREAL_LLM_SERVER_ADDRS`` is read."""
    max_concurrent_rollouts: int | None = None
    """Episodes in flight at once; None means the train batch size."""
    max_staleness: int = 1
    """Max versions an accepted sample may lag the trainer (AReaL's max_head_offpolicyness); 0 is synchronous RL."""
    queue_size: int | None = None
    """Bound of the input and output queues; None means 4x max_concurrent_rollouts."""
    request_timeout: float = 3600.0
    """Seconds one HTTP generation request may take on a server before it counts as failed, its retries
    and their backoff included (a reply that never starts uses all of it; a body that stalls after its
    headers is cut after ``request_timeout / (request_retries + 1)`` and retried)."""
    request_retries: int = 3
    """Retries of a failed request (connection error, 5xx, timeout) before the server is marked unhealthy."""
    retry_backoff: float = 1.0
    """Initial backoff in seconds between retries, doubled after each."""
    setup_timeout: float = 300.0
    """Seconds to wait for every server to answer its health check."""
    pause_grace_period: float = 0.5
    """Seconds an interrupted request waits before it is continued (lets the weight update finish)."""
    switch_interval_ms: float = 0.2
    """The interpreter's thread switch interval (``sys.setswitchinterval``) in the process that runs the
    pool, set when the pool starts; 0 leaves the interpreter's (5 ms). The pool's loop thread makes many
    small socket reads and writes per turn, each releasing the interpreter lock; while the trainer's
    Python holds it, each costs the loop one interval to get it back. With 5 ms, a trainer step that
    holds the lock for half its time left the loop 0.46 s behind at 8 servers (``docs/guides/scale-simulation.md``)."""
    schedule_policy: Literal["least_loaded", "round_robin"] = "least_loaded"
    """Server choice for a new request; requests continuing an episode stick to their server."""
    dump_trajectories: bool = False
    """Write every trajectory to ``{fileroot}/{experiment}/{trial}/rollout/{version}/{task_id}.jsonl``."""
    max_connections: int | None = None
    """Open HTTP connections to the servers at once (more requests wait for one); None: 16 x max_concurrent_rollouts, at least 64."""
    unhealthy_retry_interval: float = 30.0
    """Seconds a server marked unhealthy (unreachable after all retries) is skipped before it is tried again."""
    episode_retries: int = 1
    """Times an episode that failed on the servers (a request failed after all its retries, or no server
    was healthy) is run again from scratch, fresh samples, before its item is dropped (logged and
    counted in ``rollout/n_dropped_items``). Errors of the workflow's own code always end the run."""
    max_failed_episodes: int = 16
    """Episodes in a row that may fail on the servers; one more ends the run naming the last failure
    (then the fault is not transient: a dead server, a request the server refuses)."""
    return_routed_experts: bool = False
    """MoE: the servers report, per generated token and layer, the top-k experts they routed it to, and
    the trainer logs how often its own routing agrees (``ppo_actor/gap/routing/topk_match``,
    :mod:`megarl.actor.moe_routing`) and can replay them (``actor.routing_replay: R3``). SGLang servers, or
    vLLM on CUDA (both started with ``--enable-return-routed-experts``; vLLM on CPU cannot). Costs
    layers x top-k int16 per token in every batch (``docs/guides/moe.md``)."""

    def check(self) -> None:
        for i, addr in enumerate(self.server_addrs):
            host, sep, port = addr.rpartition(":")
            require(bool(host) and sep == ":" and port.isdigit(), f"server_addrs[{i}]", addr, "expected 'host:port'")
            require(1 <= int(port) <= 65535, f"server_addrs[{i}]", addr, "the port must be in [1, 65535]")
            first = self.server_addrs.index(addr)
            require(first == i, f"server_addrs[{i}]", addr, f"listed twice (also server_addrs[{first}])")
        if self.max_concurrent_rollouts is not None:
            require(
                self.max_concurrent_rollouts >= 1,
                "max_concurrent_rollouts",
                self.max_concurrent_rollouts,
                "must be >= 1 (or null for the train batch size)",
            )
        if self.queue_size is not None:
            require(self.queue_size >= 1, "queue_size", self.queue_size, "must be >= 1")
        require(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0")
        require(self.request_timeout > 0, "request_timeout", self.request_timeout, "must be > 0 seconds")
        require(self.request_retries >= 0, "request_retries", self.request_retries, "must be >= 0")
        require(self.retry_backoff >= 0, "retry_backoff", self.retry_backoff, "must be >= 0 seconds")
        require(self.setup_timeout > 0, "setup_timeout", self.setup_timeout, "must be > 0 seconds")
        require(self.pause_grace_period >= 0, "pause_grace_period", self.pause_grace_period, "must be >= 0 seconds")
        require(self.switch_interval_ms >= 0, "switch_interval_ms", self.switch_interval_ms, "must be >= 0 ms")
        if self.max_connections is not None:
            require(self.max_connections >= 1, "max_connections", self.max_connections, "must be >= 1")
        require(
            self.unhealthy_retry_interval >= 0,
            "unhealthy_retry_interval",
            self.unhealthy_retry_interval,
            "must be >= 0 seconds",
        )
        require(self.episode_retries >= 0, "episode_retries", self.episode_retries, "must be >= 0")
        require(self.max_failed_episodes >= 1, "max_failed_episodes", self.max_failed_episodes, "must be >= 1")


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's ``--max-lora-rank`` takes (``vllm/config/lora.py``): a server serving adapters of
rank r is started with the smallest one >= r."""
MAX_SERVED_LORA_RANK = VLLM_LORA_RANKS[-1]


@dataclass
class VLLMConfig:
    """Options of ``python -m vllm.entrypoints.openai.api_server`` (one server per replica)."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weights and activations dtype of the server. ``auto`` is megarl's hardware choice (bfloat16 on
    CUDA and on CPUs with native bf16, float32 elsewhere), not vLLM's "dtype of the checkpoint"."""
    max_model_len: int = 2048
    """Context length (prompt + generation) the server accepts."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory for weights and KV cache (GPU only)."""
    cpu_kvcache_space_gb: int = 1
    """KV cache size in GiB on CPU (``VLLM_CPU_KVCACHE_SPACE``)."""
    enforce_eager: bool = True
    """Disable CUDA graphs / ``torch.compile``: a faster start. On CPU a compiled server's first start on a
    machine compiles the model, later starts load it from vLLM's compile cache (one entry per CPU kind:
    :mod:`megarl.serving.vllm_compile_cache`); what each costs and saves: ``docs/guides/performance.md``."""
    enable_prefix_caching: bool = True
    """Reuse KV cache across requests sharing a prefix (a GRPO group's prompt, continued generations)."""
    block_size: int | None = None
    """Tokens per KV-cache block; None: vLLM's default (128 on CPU). The prefix cache only shares
    whole blocks, so a group's samples recompute their prompt's last ``len % block_size`` tokens:
    short prompts on CPU want 32 (the smallest vLLM-CPU accepts; multiples of 32 there)."""
    max_num_seqs: int = 256
    """Sequences batched at once by the scheduler."""
    seed: int = 1
    """Sampling seed of the server (>= 0; each replica adds its index)."""
    startup_timeout: float = 600.0
    """Seconds to wait for the server's health check after launch."""
    extra_args: list[str] = field(default_factory=list)
    """Further command-line arguments passed verbatim, e.g. ``["--swap-space", "4"]``."""

    def check(self) -> None:
        require(self.max_model_len >= 16, "max_model_len", self.max_model_len, "must be >= 16")
        require(
            0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]"
        )
        require(self.cpu_kvcache_space_gb >= 1, "cpu_kvcache_space_gb", self.cpu_kvcache_space_gb, "must be >= 1")
        require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        require(self.seed >= 0, "seed", self.seed, "must be >= 0")
        require(self.startup_timeout > 0, "startup_timeout", self.startup_timeout, "must be > 0 seconds")
        if self.block_size is not None:
            require(
                self.block_size >= 16 and self.block_size % 16 == 0,
                "block_size",
                self.block_size,
                "must be a multiple of 16 (of 32 on CPU), or null for vLLM's default",
            )


@dataclass
class SGLangConfig:
    """Options of ``python -m sglang.launch_server`` (one server per replica; CUDA only)."""

    dtype: Literal["auto", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype of the server; ``auto`` is bfloat16 (SGLang serves on CUDA only)."""
    context_length: int = 2048
    """Context length (prompt + generation) the server accepts."""
    mem_fraction_static: float = 0.8
    """Fraction of GPU memory for weights and KV cache."""
    attention_backend: str | None = None
    """SGLang attention backend (``fa3``, ``flashinfer``, ``triton``); None lets SGLang choose."""
    disable_cuda_graph: bool = False
    """Disable CUDA graphs (faster start, slower decode)."""
    enable_metrics: bool = True
    """Expose Prometheus metrics."""
    random_seed: int = 1
    """Sampling seed of the server (>= 0; each replica adds its index)."""
    startup_timeout: float = 600.0
    """Seconds to wait for the server's health check after launch."""
    extra_args: list[str] = field(default_factory=list)
    """Further command-line arguments passed verbatim."""

    def check(self) -> None:
        require(self.context_length >= 16, "context_length", self.context_length, "must be >= 16")
        require(self.random_seed >= 0, "random_seed", self.random_seed, "must be >= 0")
        require(0 < self.mem_fraction_static < 1, "mem_fraction_static", self.mem_fraction_static, "in (0, 1)")
        require(self.startup_timeout > 0, "startup_timeout", self.startup_timeout, "must be > 0 seconds")


WORKFLOW_SHORT_NAMES = {
    "rlvr": "megarl.workflow.rlvr.RLVRWorkflow",
    "multi_turn": "megarl.workflow.multi_turn.MultiTurnReflectionWorkflow",
}
"""Built-in workflows by short name (``workflow.type``)."""
CLASS_FORMS = "'package.module.Class' or 'path/to/file.py:Class'"
"""The two spellings of a workflow class, for messages."""
RUN_ARGUMENTS = ("reward_fn", "gconfig", "tokenizer", "max_context_len", "reward_config")
"""Constructor arguments the trainer fills in from the run when a workflow takes them and
``kwargs`` does not give them: the imported ``reward_fn``, ``gconfig`` (evaluation: greedy, one
sample), the tokenizer, the servers' context length and the ``reward`` section (:class:`RewardConfig`)."""


@dataclass
class RewardConfig:
    """How the built-in workflows call ``reward_fn``: in worker processes (an ``async def`` one on the
    rollout's event loop), each call bounded in time, with ``kwargs`` beside the row's fields, and what
    happens when the function fails (it is the user's code: :mod:`megarl.reward.failures`).

    A call *fails* when the function raises, runs past ``timeout_seconds`` or kills its worker: it scores 0,
    is counted in ``rollout/reward/error`` or ``rollout/reward/timeout`` and shown on the step's console
    line. The run stops, naming the function, the exception with its traceback and the row, when each of
    the run's first 8 calls failed, or when more than ``max_error_fraction`` of the last ``error_window``
    calls did. A return value that is not a finite number (None, text, NaN, inf) stops the run at once.
    """

    timeout_seconds: float = 15.0
    """Bound on one reward call, from when a worker process starts it (a cold worker's start-up is not
    counted; an ``async def`` reward's from its start, cancelled then). A call still running then scores 0
    and counts as a failed call (``rollout/reward/timeout``)."""
    max_error_fraction: float = 0.5
    """The run stops when more than this fraction of the last ``error_window`` reward calls failed
    (raised or timed out); 1.0: only the first calls' rule and bad values stop it."""
    error_window: int = 64
    """Reward calls over which ``max_error_fraction`` is measured (a sliding window, from the run's
    ``error_window``-th call on)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments every call gets beside the row's fields: a reward service's ``url``
    (:mod:`megarl.reward.remote`), a judge's ``judge_url`` and ``judge_model`` (:mod:`megarl.reward.judge`),
    your own reward's settings. A name that is also a column of the dataset's rows is refused."""

    def check(self) -> None:
        require(self.timeout_seconds > 0, "timeout_seconds", self.timeout_seconds, "must be > 0 seconds")
        bad = [name for name in self.kwargs if not str(name).isidentifier()]
        require(not bad, "kwargs", self.kwargs, f"{bad} cannot be keyword argument names")
        require(
            0 < self.max_error_fraction <= 1,
            "max_error_fraction",
            self.max_error_fraction,
            "must be in (0, 1] (1.0: the fraction never stops the run)",
        )
        require(self.error_window >= 1, "error_window", self.error_window, "must be >= 1")


MAX_TEACHER_TOP_K = 64
"""The most tokens per position a teacher's top k (``teacher.top_k``) may hold."""


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher: inference servers serving it, which score every trajectory the
    policy samples (the teacher's logprob of each of its tokens) before the trainer takes it; the actor's
    advantages then gain ``-actor.teacher_coef * (log pi(o_t) - log pi_teacher(o_t))`` per generated token
    (:func:`megarl.actor.advantages.teacher_advantages`; ``docs/concepts/algorithms.md``).

    The teacher must share the actor's tokenizer (checked at start). It runs on servers of its own (vLLM or
    SGLang, any size and tensor-parallel layout), started as for an LLM judge: megarl does not start them.
    Or, with ``path``, in the trainer's own processes, as the KL's reference model does (slime's
    ``opd_type`` megatron): a model of a family megarl trains, in the actor's layout and dtype.
    """

    addresses: list[str] = field(default_factory=list)
    """``host:port`` of each server serving the teacher; requests go to the least busy."""
    path: str | None = None
    """Instead of servers: the teacher model (an HF directory or a short name) loaded by the trainer, which
    scores each batch in a forward pass of its own (phase ``teacher_logp``) before the advantages."""
    backend: Literal["vllm", "sglang"] = "vllm"
    """The teacher servers' family."""
    top_k: int = 0
    """0: the teacher's logprob of each sampled token, whose reverse KL goes into the advantages. k > 0: also
    its k most likely tokens at each generated position, and the teacher's term is instead the forward KL
    ``sum_j q_j (log q_j - log pi(v_j))`` over them, a term of the actor's loss weighted by ``actor.teacher_coef``
    (NeMo-RL's distillation loss; :mod:`megarl.actor.teacher_loss`). At most :data:`MAX_TEACHER_TOP_K`; a vLLM
    teacher serves up to its ``--max-logprobs`` (20 by default)."""
    request_timeout: float = 600.0
    """Seconds one scoring request may take, its retries included; a server that fails it is passed over
    for the next, and a trajectory no server could score fails its episode (the run stops, naming it)."""
    request_retries: int = 3
    """Retries of a failed scoring request (connection error, 5xx, timeout) on one server."""
    max_connections: int = 64
    """Connections open to the teacher servers at once (requests beyond it wait for one)."""

    def check(self) -> None:
        require(
            bool(self.addresses) != bool(self.path),
            "addresses",
            self.addresses,
            "name at least one 'host:port' serving the teacher, or its model as teacher.path (one of the two)"
            if not self.path
            else f"a teacher in the trainer (path={self.path!r}) takes no servers: give one of the two",
        )
        for i, addr in enumerate(self.addresses):
            host, sep, port = addr.rpartition(":")
            require(bool(host) and sep == ":" and port.isdigit(), f"addresses[{i}]", addr, "expected 'host:port'")
            require(1 <= int(port) <= 65535, f"addresses[{i}]", addr, "the port must be in [1, 65535]")
        require(self.backend in ("vllm", "sglang"), "backend", self.backend, "must be vllm or sglang")
        require(
            0 <= self.top_k <= MAX_TEACHER_TOP_K,
            "top_k",
            self.top_k,
            f"must be in [0, {MAX_TEACHER_TOP_K}] (0: the sampled token only)",
        )
        require(self.request_timeout > 0, "request_timeout", self.request_timeout, "must be > 0 seconds")
        require(self.request_retries >= 0, "request_retries", self.request_retries, "must be >= 0")
        require(self.max_connections >= 1, "max_connections", self.max_connections, "must be >= 1")


@dataclass
class WorkflowConfig:
    """The rollout workflow the trainer runs on each prompt: a built-in or a user's class.

    Built with ``Class(**kwargs)`` plus those of :data:`RUN_ARGUMENTS` its constructor takes
    (a ``reward_fn`` given in ``kwargs`` as ``package.module.function`` is imported). The class
    needs an ``async def arun_episode(engine, data)`` (:class:`megarl.api.workflow_api.RolloutWorkflow`)
    returning ``gconfig.n_samples * group_size`` rows per prompt, or is an agent (AReaL's
    ``async def run(data, **extra_kwargs)`` on an OpenAI client, returning its reward), which
    runs ``gconfig.n_samples`` times per prompt behind the OpenAI-compatible proxy
    (:mod:`megarl.workflow.openai_agent`). Checked before launch (:mod:`megarl.run.prelaunch`): the
    class imports, has ``arun_episode`` or ``run``, and its constructor takes these arguments.
    """

    type: str = "rlvr"
    """A built-in (``rlvr``: one answer per sample; ``multi_turn``: retry with a reflection prompt
    after a wrong answer) or a workflow's or an agent's class: ``package.module.Class`` or
    ``path/to/file.py:Class`` (found as :mod:`megarl.utils.plugins` says)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments beyond those filled in from the run (e.g. ``max_turns: 3``)."""
    group_size: int = 1
    """Run the workflow this many times per prompt and concatenate (AReaL's grouped rollout):
    for a workflow that samples once, the GRPO group. Keep 1 for workflows that sample
    ``gconfig.n_samples`` themselves (the built-ins)."""

    @property
    def class_path(self) -> str:
        """``package.module.Class`` of ``type``."""
        return WORKFLOW_SHORT_NAMES.get(self.type, self.type)

    def check(self) -> None:
        require(self.group_size >= 1, "group_size", self.group_size, "must be >= 1")
        require(
            self.type != "grouped",
            "type",
            self.type,
            "a grouped rollout is any workflow run several times per prompt: set group_size: N instead",
        )
        problem = builtin_or_plugin_problem(self.type, WORKFLOW_SHORT_NAMES, "workflow", CLASS_FORMS)
        require(problem is None, "type", self.type, problem)
