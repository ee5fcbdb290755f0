"""Config of the weight bridge: how trainer weights reach the inference servers after each step."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Literal

from megarl.config.base import require

_HOST = re.compile(r"|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[?[0-9A-Fa-f:.]+\]?")


@dataclass
class WeightUpdateConfig:
    """Weight synchronisation (``megarl.bridge``)."""

    mode: Literal["broadcast", "sharded", "disk"] = "sharded"
    """``sharded``: each inference worker receives only its own slices (vLLM only); ``broadcast``:
    full HF tensors to every worker (vLLM and SGLang); ``disk``: HF safetensors written by the
    owning stages, reloaded by the servers."""
    lora: Literal["merged", "adapter"] = "merged"
    """With LoRA adapters on the actor (``actor.lora.rank > 0``): ``merged`` sends the base weights
    with ``(alpha / rank) B A`` added, computed on the trainer from each tensor-parallel shard before
    any gather, conversion or resharding, so every mode and server kind serves a plain model (the
    trainer's own weights are not written). ``adapter``: the servers keep their base weights and load
    the adapters alone as a LoRA adapter, a new one per version, under ``disk_path``
    (:mod:`megarl.bridge.adapter`; a few percent of the model per update). No effect without adapters."""
    extra_modes: list[str] = field(default_factory=list)
    """Other modes to wire at connection time, so one run can switch between them (benchmarks)."""
    bucket_mb: float | None = None
    """Bucket size in MiB; None: 1024 on GPU, 64 on CPU (gloo)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype on the wire (and of disk checkpoints); ``auto`` is the servers' dtype."""
    stage: bool = True
    """vLLM: receive a whole update before applying it, so a failure mid-transfer leaves the old
    weights in place (costs 1 / TP of the model in memory per worker in sharded mode, the whole
    model in broadcast mode; a CPU worker keeps those buffers from one update to the next,
    :class:`~megarl.bridge.transport.ReceiveBuffers`). False applies buckets as they arrive; a
    failed server is then marked unhealthy."""
    disk_path: str = ""
    """Disk mode and adapter sync: directory on storage shared by trainer and servers (one sub-directory
    per version); empty with adapter sync: ``{run_dir}/weight_updates``."""
    keep_disk_versions: int = 2
    """Disk mode: how many version sub-directories to keep."""
    master_address: str = ""
    """Address the servers use to reach the trainer ranks that host groups; empty: this host's IP."""
    init_timeout: float = 600.0
    """Seconds to form the groups (servers joining) before giving up."""
    servers_per_group: int = 16
    """Sharded mode: the sending trainer ranks form one group with the workers of each run of this
    many servers (a group per block), so a server that dies, is evicted, restarts, joins or leaves
    re-forms its own block's group only: the other servers keep theirs and are not re-initialised.
    Each sending rank holds one group per block. 0: one group of every server (any change re-forms
    it). Broadcast mode always forms one group per sender over every server's workers (a group per
    block would send each bucket once per block)."""
    update_timeout: float = 1800.0
    """Seconds one update (any transfer or control call in it) may take: the cap. A server far slower
    than the others is evicted earlier, at its relative deadline (``straggler_factor``)."""
    straggler_factor: float = 4.0
    """Relative deadline of each stage of an update (a server paused, a server committed): once half
    the servers have answered it, the others must within ``max(straggler_floor_s, straggler_factor x``
    the median answer time)``; later they are evicted and named (a slow-but-alive server, or one whose
    health check answers while its control routes hang), instead of every server waiting paused up to
    ``update_timeout``. 0: no relative deadline (``update_timeout`` only)."""
    straggler_floor_s: float = 30.0
    """The shortest relative deadline of an update's stage (``straggler_factor``), in seconds."""
    max_failed_fraction: float = 0.25
    """Share of the servers an update may fail on while the run goes on: those servers (a hung or
    erroring one; a dead one always) are taken out of rotation and named in a warning and in
    ``weight_sync/servers_evicted``, and serve again once the launcher restarts them. More
    failures, or a failure on the trainer's side, stop the run (``WeightBridgeError``). 0: any
    failed server stops the run."""
    consistency_threshold: float = 0.1
    """Fail the update when any server's mean |logprob - trainer logprob| over the probe tokens
    exceeds this; <= 0 disables the check (max and mean are logged either way)."""
    gap_threshold: float | None = None
    """Warn on the console when the trained tokens generated by the current weights (version lag 0)
    differ from the trainer's logprobs by more than this on average (``ppo_actor/gap/...``, see
    ``megarl.actor.gap``); None: ``consistency_threshold``; <= 0: never warn."""
    probe_sequences: int = 2
    """Probe: trajectories sampled from the servers once, then scored by trainer and servers after each update."""
    probe_tokens: int = 32
    """Probe: tokens generated per probe trajectory."""
    probe_every: int = 4
    """Probe after every this many updates (the first update of a trainer process always), so that
    it costs little of a step (``benchmarks/e2e_step.py`` reports its share); its metrics are logged
    at every probe. 1 probes every update."""
    probe_topk: int = 20
    """Full-distribution probe: at every probe position each server's top-k logprobs (this k) are
    compared with the trainer's logprobs of the same tokens (``weight_sync/topk_kl``,
    ``topk_logprob_diff_max`` / ``_mean``; a warning above ``gap_threshold``); 0: off. vLLM servers only."""

    def relative_deadline(self, times: list[float]) -> float:
        """Seconds a server (or a worker's message) may take, given how long the others took (``times``):
        ``max(straggler_floor_s, straggler_factor x`` their median``)``, at most ``update_timeout``, which
        is also the deadline before any time is known or with ``straggler_factor`` 0."""
        return self.deadline_after(statistics.median(times) if times else None)

    def deadline_after(self, median: float | None) -> float:
        """:meth:`relative_deadline` given the others' median time (None: none known yet)."""
        if self.straggler_factor <= 0 or median is None:
            return self.update_timeout
        return min(self.update_timeout, max(self.straggler_floor_s, self.straggler_factor * median))

    def check(self) -> None:
        modes = ("broadcast", "sharded", "disk")
        require(self.mode in modes, "mode", self.mode, f"must be one of {modes}")
        require(self.lora in ("merged", "adapter"), "lora", self.lora, "must be 'merged' or 'adapter'")
        for mode in self.extra_modes:
            require(mode in modes, "extra_modes", mode, f"entries must be among {modes}")
        require(self.bucket_mb is None or self.bucket_mb > 0, "bucket_mb", self.bucket_mb, "must be > 0 (or null)")
        require(
            "disk" not in self.modes or bool(self.disk_path), "disk_path", self.disk_path, "disk mode needs a directory"
        )
        require(
            _HOST.fullmatch(self.master_address) is not None,
            "master_address",
            self.master_address,
            "expected a host name or an IP address (empty: this host's)",
        )
        require(self.servers_per_group >= 0, "servers_per_group", self.servers_per_group, "must be >= 0 (0: one group)")
        require(self.keep_disk_versions >= 1, "keep_disk_versions", self.keep_disk_versions, "must be >= 1")
        require(
            0.0 <= self.max_failed_fraction < 1.0, "max_failed_fraction", self.max_failed_fraction, "must be in [0, 1)"
        )
        require(
            self.straggler_factor == 0 or self.straggler_factor >= 1,
            "straggler_factor",
            self.straggler_factor,
            "must be 0 (off) or >= 1 (a multiple of the median answer time)",
        )
        for name in ("init_timeout", "update_timeout", "straggler_floor_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        require(self.probe_sequences >= 0, "probe_sequences", self.probe_sequences, "must be >= 0")
        require(self.probe_tokens >= 2, "probe_tokens", self.probe_tokens, "must be >= 2")
        require(self.probe_every >= 1, "probe_every", self.probe_every, "must be >= 1 (updates between probes)")
        require(self.probe_topk >= 0, "probe_topk", self.probe_topk, "must be >= 0 (0: off)")

    @property
    def modes(self) -> tuple[str, ...]:
        """Every mode to wire: ``mode`` then ``extra_modes``."""
        return tuple(dict.fromkeys([self.mode, *self.extra_modes]))

    def group_servers(self, servers: int) -> int:
        """How many of ``servers`` servers one bridge group holds (``servers_per_group``; all of them
        when 0 or when broadcast mode is wired)."""
        if self.servers_per_group == 0 or "broadcast" in self.modes:
            return max(servers, 1)
        return self.servers_per_group

    def bucket_bytes(self, on_gpu: bool) -> int:
        mb = self.bucket_mb if self.bucket_mb is not None else (1024 if on_gpu else 64)
        return int(mb * 2**20)
