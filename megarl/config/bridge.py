"""Config of the weight bridge: how trainer weights reach the inference servers after each step."""

from __future__ import annotations

import re
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
    extra_modes: list[str] = field(default_factory=list)
    """Other modes to wire at connection time, so one run can switch between them (benchmarks)."""
    bucket_mb: float | None = None
    """Bucket size in MiB; None: 1024 on GPU, 64 on CPU (gloo)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype on the wire (and of disk checkpoints); ``auto`` is the servers' dtype."""
    stage: bool = True
    """vLLM: receive a whole update before applying it, so a failure mid-transfer leaves the old
    weights in place (costs 1 / TP of the model in memory per worker in sharded mode, the whole
    model in broadcast mode). False applies buckets as they arrive; a failed server is then
    marked unhealthy."""
    disk_path: str = ""
    """Disk mode: directory on storage shared by trainer and servers (one sub-directory per version)."""
    keep_disk_versions: int = 2
    """Disk mode: how many version sub-directories to keep."""
    master_address: str = ""
    """Address the servers use to reach the trainer ranks that host groups; empty: this host's IP."""
    init_timeout: float = 600.0
    """Seconds to form the groups (servers joining) before giving up."""
    update_timeout: float = 1800.0
    """Seconds one update (any transfer or control call in it) may take."""
    consistency_threshold: float = 0.1
    """Fail the update when any server's mean |logprob - trainer logprob| over the probe tokens
    exceeds this; <= 0 disables the check (max and mean are logged either way)."""
    probe_sequences: int = 2
    """Probe: trajectories sampled from the servers once, then scored by trainer and servers after each update."""
    probe_tokens: int = 32
    """Probe: tokens generated per probe trajectory."""
    probe_every: int = 4
    """Probe after every this many updates (the first update of a trainer process always), so that
    it costs little of a step (``benchmarks/e2e_step.py`` reports its share); its metrics are logged
    at every probe. 1 probes every update."""

    def check(self) -> None:
        modes = ("broadcast", "sharded", "disk")
        require(self.mode in modes, "mode", self.mode, f"must be one of {modes}")
        for mode in self.extra_modes:
            require(mode in modes, "extra_modes", mode, f"entries must be among {modes}")
        require(self.bucket_mb is None or self.bucket_mb > 0, "bucket_mb", self.bucket_mb, "must be > 0 (or null)")
        require("disk" not in self.modes or bool(self.disk_path), "disk_path", self.disk_path, "disk mode needs a directory")
        if "disk" in self.modes:
            from megarl.config.files import writable_dir_problem

            problem = writable_dir_problem(self.disk_path)
            require(problem is None, "disk_path", self.disk_path, f"each update is written there: {problem}")
        require(_HOST.fullmatch(self.master_address) is not None, "master_address", self.master_address,
                "expected a host name or an IP address (empty: this host's)")  # fmt: skip
        require(self.keep_disk_versions >= 1, "keep_disk_versions", self.keep_disk_versions, "must be >= 1")
        for name in ("init_timeout", "update_timeout"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        require(self.probe_sequences >= 0, "probe_sequences", self.probe_sequences, "must be >= 0")
        require(self.probe_tokens >= 2, "probe_tokens", self.probe_tokens, "must be >= 2")
        require(self.probe_every >= 1, "probe_every", self.probe_every, "must be >= 1 (updates between probes)")

    @property
    def modes(self) -> tuple[str, ...]:
        """Every mode to wire: ``mode`` then ``extra_modes``."""
        return tuple(dict.fromkeys([self.mode, *self.extra_modes]))

    def bucket_bytes(self, on_gpu: bool) -> int:
        mb = self.bucket_mb if self.bucket_mb is not None else (1024 if on_gpu else 64)
        return int(mb * 2**20)
