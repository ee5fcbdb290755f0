"""Configs of a run's surroundings: cluster, data, saving, evaluation, recovery, logging."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from megarl.config.base import require
from megarl.utils.plugins import FORMS, is_plugin_path

_SLURM_TIME = re.compile(r"(?i)unlimited|infinite|\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")
_SLURM_MEM = re.compile(r"\d+[KMGT]?")
_INTERFACE = re.compile(r"[A-Za-z0-9_.:-]{1,15}")  # Linux: IFNAMSIZ - 1 characters
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class ClusterConfig:
    """The machines of the run. On CPU a "GPU" is a process slot."""

    n_nodes: int = 1
    """Number of nodes."""
    n_gpus_per_node: int = 2
    """Devices per node; nodes x devices must equal the devices of ``allocation_mode``."""
    fileroot: str = "outputs"
    """Root of every run's outputs: ``{fileroot}/{experiment_name}/{trial_name}/``."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the trainer runs; ``auto`` is CUDA when available, else CPU (gloo)."""
    cpu_threads: Literal["elastic", "static", "shared"] = "elastic"
    """CPU only: who computes on which cores. ``static``: each server on its own cores, the trainer
    on the rest (``OMP_NUM_THREADS``), always. ``elastic``: the same, but the trainer takes every
    core of the machine (split among the local ranks) in the phases where the servers have no
    work: the weight sync (paused) and a recompute or update that starts with no episode running
    (synchronous RL, or the pool already at its staleness bound). ``shared``: ``elastic``, and the
    servers run on every core too, for synchronous RL (``rollout.max_staleness: 0``) where server
    and trainer take turns; the servers at a lower CPU priority (``nice`` 10,
    ``megarl.launcher.serve.SHARED_CORES_NICE``), so the trainer's update goes first when both have
    work. ``benchmarks/e2e_step.py`` measures them."""
    cpu_heap_growth: float | None = 1.25
    """CPU only: the trainer keeps the memory a phase frees for the next one (no page faults to pay
    again), and batches of new sizes slowly fragment that heap; once its resident size at the end of a
    step passes this many times its size after the second step, the free part goes back to the OS
    (``memory/heap_trims`` counts it; the next phases fault their pages in again), and two steps later
    the size settles again (the larger one kept). ``null``: never."""

    def check(self) -> None:
        require(self.n_nodes >= 1, "n_nodes", self.n_nodes, "must be >= 1")
        require(self.n_gpus_per_node >= 1, "n_gpus_per_node", self.n_gpus_per_node, "must be >= 1")
        require(bool(self.fileroot), "fileroot", self.fileroot, "an output directory is required")
        require(
            self.cpu_heap_growth is None or self.cpu_heap_growth > 1,
            "cpu_heap_growth",
            self.cpu_heap_growth,
            "must be > 1 (a multiple of the settled size), or null",
        )


DATASET_TYPES = ("gsm8k", "chat")
"""The built-in row formats (``megarl.data.rows.ROW_MAPPERS``; a test checks they agree)."""


@dataclass
class DatasetConfig:
    """A prompt dataset and its loader."""

    path: str = "gsm8k"
    """``gsm8k`` (the bundled copy), a local directory or .jsonl/.parquet file, or a hub name."""
    type: str = "gsm8k"
    """Row format: ``gsm8k`` (question, and a solution ending in ``#### <number>``), ``chat``
    (``messages`` or ``prompt``, plus ``answer``), or your row adapter, ``my_rows.py:to_row`` or
    ``package.module.to_row`` (found as :mod:`megarl.utils.plugins` says): a function from a raw
    row (a dict) to a ``chat`` row, its other keys passed to the reward
    (``examples/verl_parquet/verl_rows.py`` reads verl's parquet layout)."""
    split: str = "train"
    """Split to read (a directory's ``{split}.jsonl``)."""
    batch_size: int = 8
    """Prompts per training step, over all data-parallel ranks (each yields n_samples trajectories)."""
    shuffle: bool = True
    """Reshuffle every epoch (seeded by the experiment seed and the epoch)."""
    num_workers: int = 0
    """Dataloader worker processes; 0: the trainer's own process loads the rows."""
    drop_last: bool = True
    """Drop the last incomplete batch of an epoch."""
    max_prompt_tokens: int | None = None
    """Drop prompts longer than this many tokens; None keeps all."""
    bad_rows: Literal["raise", "skip"] = "raise"
    """A row its ``type`` cannot read (a missing, empty or mistyped field, a GSM8K final answer that
    is blank or not a number, a chat role other than system/user/assistant/tool, a row adapter that
    raises on the row or returns no chat row, a line that is not JSON or not UTF-8): ``raise`` stops
    the load naming file and row; ``skip`` drops it, and the count and the first one are logged and
    shown on the console when the run starts."""

    def check(self) -> None:
        require(bool(self.path), "path", self.path, "a dataset path or name is required")
        require(
            self.type in DATASET_TYPES or is_plugin_path(self.type),
            "type",
            self.type,
            f"one of {list(DATASET_TYPES)} or a row adapter, {FORMS}",
        )
        require(self.batch_size >= 1, "batch_size", self.batch_size, "must be >= 1")
        require(self.num_workers >= 0, "num_workers", self.num_workers, "must be >= 0")
        if self.max_prompt_tokens is not None:
            require(self.max_prompt_tokens >= 1, "max_prompt_tokens", self.max_prompt_tokens, "must be >= 1")


@dataclass
class SaverConfig:
    """Periodic checkpoints. A save happens when any frequency that is set is reached."""

    freq_epochs: int | None = None
    """Save every this many epochs."""
    freq_steps: int | None = None
    """Save every this many training steps."""
    freq_secs: int | None = None
    """Save when this many seconds passed since the last save."""
    export_hf: bool = False
    """Also export an HF directory (safetensors) next to the Megatron checkpoint."""
    with_optim: bool = True
    """Include the optimizer state (Adam's two moments and the fp32 master weights: about 3x
    the weights). False: weights only, to use or to start a new run from; resuming a run
    exactly is ``recover``'s job, which always keeps it."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted."""

    def check(self) -> None:
        for name in ("freq_epochs", "freq_steps", "freq_secs"):
            value = getattr(self, name)
            if value is not None:
                require(value >= 1, name, value, "must be >= 1 (or null to disable)")
        require(self.keep_last >= 1, "keep_last", self.keep_last, "must be >= 1")


@dataclass
class EvaluatorConfig:
    """Periodic evaluation on the validation split: greedy pass@1, or pass@k of sampled sequences."""

    freq_epochs: int | None = None
    """Evaluate every this many epochs."""
    freq_steps: int | None = None
    """Evaluate every this many training steps."""
    freq_secs: int | None = None
    """Evaluate when this many seconds passed since the last evaluation."""
    max_samples: int | None = None
    """Evaluate on at most this many prompts; None uses the whole split."""
    before_training: bool = False
    """Also evaluate before the first step (not after a recovery): the summary then shows pass@1
    before training beside the last evaluations'."""
    n_samples: int = 1
    """Sequences per prompt. 1 decodes greedily (unless ``temperature`` is set); above 1 they are sampled
    (``temperature``, else ``gconfig.temperature``) and the step also logs ``eval/pass@k`` for k = 2, 4, ...
    up to ``n_samples`` (the unbiased estimator), ``eval/pass@1`` being the mean over all sequences."""
    temperature: float | None = None
    """Sampling temperature of the evaluation; None: greedy with one sample, ``gconfig.temperature`` with more."""

    def check(self) -> None:
        for name in ("freq_epochs", "freq_steps", "freq_secs", "max_samples"):
            value = getattr(self, name)
            if value is not None:
                require(value >= 1, name, value, "must be >= 1 (or null to disable)")
        require(self.n_samples >= 1, "n_samples", self.n_samples, "must be >= 1")
        if self.temperature is not None:
            require(self.temperature > 0, "temperature", self.temperature, "must be > 0 (null decodes greedily)")

    @property
    def greedy(self) -> bool:
        """One greedy answer per prompt (greedy pass@1), not sampled ones."""
        return self.n_samples == 1 and self.temperature is None


@dataclass
class RecoverConfig:
    """Crash recovery: model, optimizer, dataloader position, rollout version and RNG."""

    mode: Literal["disabled", "auto", "resume"] = "disabled"
    """``auto`` resumes when a recover checkpoint exists; ``resume`` requires one; ``disabled`` starts fresh."""
    freq_steps: int | None = 1
    """Write the recover checkpoint every this many steps."""
    freq_secs: int | None = None
    """Write the recover checkpoint when this many seconds passed since the last one."""
    retries: int = 3
    """Times the launcher restarts a failed trainer in ``auto`` mode."""
    keep_last: int = 2
    """Recover points kept on disk: when the newest turns out incomplete (a file truncated or lost
    after it was written), recovery falls back to the one before, with a warning."""

    def check(self) -> None:
        for name in ("freq_steps", "freq_secs"):
            value = getattr(self, name)
            if value is not None:
                require(value >= 1, name, value, "must be >= 1 (or null to disable)")
        require(self.retries >= 0, "retries", self.retries, "must be >= 0")
        require(self.keep_last >= 1, "keep_last", self.keep_last, "must be >= 1")


@dataclass
class WandBConfig:
    """Weights & Biases logging."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    """``offline`` writes runs locally (sync later with ``wandb sync``)."""
    project: str = "megarl"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""
    tags: list[str] = field(default_factory=list)
    """Run tags."""


@dataclass
class TensorBoardConfig:
    """TensorBoard logging."""

    enabled: bool = False
    """Write event files to ``{run dir}/tensorboard``."""


@dataclass
class StatsLoggerConfig:
    """Where the exported ``stats_tracker`` values go (rank 0 only)."""

    console: bool = True
    """Log a table of every stat at each step (to ``logs/trainer.log``; on the console with ``launcher.verbose``)."""
    wandb: WandBConfig = field(default_factory=WandBConfig)
    """Weights & Biases."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """TensorBoard."""
    plot_keys: list[str] = field(default_factory=lambda: ["batch/reward/avg", "eval/pass@1"])
    """Curves drawn into ``{run dir}/curves.png`` at each log step (``batch/reward/avg``: mean reward of the
    trajectories trained on in that step)."""
    report_every: int | None = 10
    """Rewrite ``{run dir}/report.html`` (``megarl report``: curves, phases, staleness, the train-inference
    gap, the dumped trajectories) every this many steps; it is written at the end of a run either way.
    None: only at the end."""

    def check(self) -> None:
        if self.report_every is not None:
            require(
                self.report_every >= 1, "report_every", self.report_every, "must be >= 1 (or null: at the end only)"
            )


@dataclass
class WatchdogConfig:
    """The hang watchdog of ``megarl run`` (``megarl.launcher.watchdog``): every trainer rank reports its
    phase (``megarl.utils.heartbeat``); one that overruns its budget is named on the console with
    what it waits for, every process's Python stacks are written to ``{run dir}/stacks/``."""

    enabled: bool = True
    """Trainer ranks keep heartbeats and the launcher watches them."""
    budget_s: float = 1800.0
    """Seconds any phase may take before it has a median (its first runs: start-up, the first
    rollout), and at most ever."""
    median_factor: float = 5.0
    """Once a phase ran 3 times, its budget is this times its median duration (but ``min_budget_s``
    at least, ``budget_s`` at most)."""
    min_budget_s: float = 120.0
    """The smallest budget a median gives: short phases vary a lot in relative terms."""
    phase_budget_s: dict[str, float] = field(default_factory=dict)
    """Fixed budgets of named phases, instead of the rule above, e.g. ``{build: 3600}`` where loading
    the model takes long, or ``{save: 7200}`` for large checkpoints. Trainer phases: ``build``,
    ``rollout``, ``sleep_servers`` (colocated placement), ``recompute_logp``, ``ref_logp``, ``critic_values``,
    ``train_step``, ``critic_train``, ``update_weights``, ``save``."""
    silent_s: float = 120.0
    """A process whose heartbeat was not refreshed for this long is reported as not responding."""
    interval_s: float = 5.0
    """Seconds between two beats of a process."""
    action: Literal["warn", "abort", "restart"] = "warn"
    """After reporting: ``warn`` keeps running (a phase is reported once); ``abort`` stops the run
    (exit 3; recover points and metrics stay); ``restart`` stops the trainer so that ``recover``
    (``mode: auto``, ``retries`` > 0) restarts it from the last recover point."""

    def check(self) -> None:
        for name in ("budget_s", "min_budget_s", "silent_s", "interval_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        require(self.median_factor >= 1, "median_factor", self.median_factor, "must be >= 1")
        for phase, budget in self.phase_budget_s.items():
            require(budget > 0, f"phase_budget_s.{phase}", budget, "must be > 0 seconds")
        require(
            self.min_budget_s <= self.budget_s,
            "min_budget_s",
            self.min_budget_s,
            f"must be <= budget_s ({self.budget_s:g})",
        )
        require(
            self.silent_s > self.interval_s,
            "silent_s",
            self.silent_s,
            f"must be longer than interval_s ({self.interval_s:g}) between two beats",
        )


@dataclass
class SlurmConfig:
    """How ``megarl slurm`` renders and submits the sbatch script."""

    partition: str | None = None
    """``--partition``; None uses the cluster default."""
    account: str | None = None
    """``--account``."""
    qos: str | None = None
    """``--qos``."""
    time_limit: str = "24:00:00"
    """``--time`` of the whole job."""
    cpus_per_node: int | None = None
    """``--cpus-per-task`` of the one task per node; None leaves Slurm's default."""
    mem: str | None = None
    """``--mem`` per node, e.g. ``"0"`` (all) or ``"512G"``."""
    exclusive: bool = True
    """``--exclusive``: the nodes are the job's alone."""
    extra_sbatch_args: list[str] = field(default_factory=list)
    """More ``#SBATCH`` lines, e.g. ``["--constraint=h100"]``."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run first in the script, e.g. ``source /shared/venv/bin/activate``."""
    server_port: int = 18000
    """Port of the first server on a node; the next servers on that node count up."""
    trainer_port: int = 29500
    """torchrun rendezvous port on the first training node."""
    rendezvous_timeout: int = 600
    """Seconds the trainer's nodes wait for each other at start (torchrun's static rendezvous); a node
    that cannot reach the first training node's address fails the job after it."""
    server_wait_timeout: int = 1800
    """Seconds the script waits for every server to be healthy before it fails the job."""
    network_interface: str | None = None
    """The nodes' cluster interface (e.g. ``ib0``, ``eth0``, ``bond0``): servers bind and announce its
    IPv4 address, and gloo / NCCL use it (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, unless
    ``launcher.env`` sets them). None: the interface of each node's default route. Servers never
    listen on every interface."""

    def check(self) -> None:
        require(
            _SLURM_TIME.fullmatch(self.time_limit) is not None,
            "time_limit",
            self.time_limit,
            "expected Slurm's --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED",
        )
        if self.mem is not None:
            require(
                _SLURM_MEM.fullmatch(self.mem) is not None,
                "mem",
                self.mem,
                "expected Slurm's --mem: a number with an optional K, M, G or T suffix ('0' is all of it)",
            )
        for name in ("server_port", "trainer_port"):
            value = getattr(self, name)
            require(1024 <= value <= 65000, name, value, "must be a port in [1024, 65000]")
        for name in ("server_wait_timeout", "rendezvous_timeout"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1 second")
        if self.cpus_per_node is not None:
            require(self.cpus_per_node >= 1, "cpus_per_node", self.cpus_per_node, "must be >= 1")
        if self.network_interface is not None:
            require(
                _INTERFACE.fullmatch(self.network_interface) is not None,
                "network_interface",
                self.network_interface,
                "expected an interface name such as ib0 or eth0 (1-15 of "
                "letters, digits, '_', '.', '-', ':'), or null for the default route's",
            )


@dataclass
class LauncherConfig:
    """How the launchers start the trainer (``megarl run`` locally, ``megarl slurm`` on a cluster)."""

    trainer_entry: str = "megarl.train"
    """Trainer entry: a module (``pkg.mod``, run with ``torchrun -m``) or a ``.py`` script path."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of every server and trainer process."""
    verbose: bool = False
    """Print every process's whole output on the console (servers, libraries, per-step stats tables).
    Off: a few start-up lines, one progress bar, a line per step and the summary; the rest is in
    ``{run_dir}/logs/`` (``trainer.log``, ``server-N.log``, ``launcher.log``) either way."""
    server_restarts: int = 3
    """Times one inference server is restarted in its slot (same devices, same address) after its process
    died; the trainer pushes the current weights and version to it before it gets requests again. 0: a
    dying server ends the run."""
    max_server_restarts: int = 10
    """Server restarts of the whole run, all servers together; past this (or past ``server_restarts`` for
    one server) a dying server ends the run, naming the budget spent. 0: no restart at all."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """Slurm specifics."""

    def check(self) -> None:
        require(bool(self.trainer_entry), "trainer_entry", self.trainer_entry, "a module or script is required")
        require(self.server_restarts >= 0, "server_restarts", self.server_restarts, "must be >= 0")
        require(self.max_server_restarts >= 0, "max_server_restarts", self.max_server_restarts, "must be >= 0")
        for name in self.env:
            require(
                _ENV_NAME.fullmatch(name) is not None,
                "env",
                name,
                "environment variable names are letters, digits and '_', not starting with a digit",
            )
