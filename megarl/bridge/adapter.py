"""Adapter weight sync (``weight_update.lora: adapter``): the servers keep the base model they started
with and serve the trainer's policy as a LoRA adapter; an update sends the adapters only.

One update to version ``v`` (collective over the trainer's ranks, like :class:`~megarl.bridge.WeightBridge`):

1. the trainer writes its adapters as a PEFT adapter directory, ``{disk_path}/lora/v<v>``, in the wire
   dtype (each rank gathers its adapters over its tensor-parallel group; global rank 0 writes);
2. rank 0 has every server load it as the adapter ``megarl-lora-v<v>`` (vLLM ``/v1/load_lora_adapter``,
   SGLang ``/load_lora_adapter``): the report names it, and the rollout side asks for it in every
   request from then on;
3. each server keeps the previous version's adapter (a request built just before the pause may still
   name it) and unloads older ones; the directories of older versions are removed.

The servers read the directory, so ``disk_path`` must be on storage they share with trainer rank 0.
What moves is ``(2 * hidden + ...) * rank`` numbers per adapted linear: a few percent of the model
at rank 16 (``UpdateReport.bytes_sent`` is the adapter file's size). The servers must have been started
with LoRA enabled (``megarl serve`` does so when the config asks for adapter sync).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megarl.bridge.bridge import UpdateReport, prune_versions
from megarl.bridge.drive import in_threads
from megarl.bridge.groups import gather_objects, rank0_object
from megarl.bridge.interface import ServerBridge
from megarl.config.bridge import WeightUpdateConfig
from megarl.serving import ServerControl, ServerRef
from megarl.utils import heartbeat

logger = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"
"""The PEFT weights file of an adapter directory (what is counted as sent)."""
KEEP_LOADED = 2
"""Adapters a server holds after an update: the new version's and the previous one's."""


def adapter_name(version: int) -> str:
    """The name a server serves version ``version`` of the adapters under."""
    return f"megarl-lora-v{version}"


class AdapterBridge(ServerBridge):
    """Trainer side of adapter weight sync (one per trainer rank): the
    :class:`~megarl.bridge.interface.ServerBridge` the weight-sync phase drives, as ``WeightBridge`` is.

    Args:
        config: The ``weight_update`` config (``disk_path``: where the adapter directories go).
        export: ``export(path, dtype)`` writes this trainer's adapters as a PEFT directory (collective;
            the engine's ``export_adapters`` with ``for_servers=True``: the scale in the form every server
            reads).
        dtype: Dtype the adapters are written in (the wire dtype).
        rank: This rank's global rank (rank 0 drives the servers).
        group: Process group of all trainer ranks (None: the default group).
    """

    def __init__(
        self,
        config: WeightUpdateConfig,
        export: Callable[[str, torch.dtype], None],
        dtype: torch.dtype,
        rank: int = 0,
        group=None,
    ):
        if not config.disk_path:
            raise ValueError("weight_update.lora=adapter needs weight_update.disk_path (storage the servers read)")
        self.config, self.export, self.dtype, self.rank, self.group = config, export, dtype, rank, group
        self.root = Path(config.disk_path) / "lora"
        self.servers: list[ServerControl | ServerRef] = []
        self.connected = False
        self._loaded: dict[str, list[str]] = {}  # server address -> adapter names it holds, oldest first

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def connect(self, servers: list[ServerControl | ServerRef]) -> None:
        """Adopt ``servers`` (no groups to form: the servers read the adapters from disk)."""
        self.servers = list(servers)
        self.connected = True
        logger.info("adapter weight sync to %d server(s), adapters under %s", len(self.servers), self.root)

    def update(self, source, version: int, mode: str | None = None, path: str | None = None) -> UpdateReport:
        """Send the trainer's adapters as ``version`` (collective); ``source`` is unused (the adapters come
        from ``export``), ``path`` overrides the version's directory. Failures are in the report."""
        start = time.perf_counter()
        out = Path(path) if path else self.root / f"v{version}"
        report = UpdateReport(version, "adapter", adapter=adapter_name(version))
        error = None
        heartbeat.step(f"weight sync: writing the adapters of version {version}")
        try:
            self.export(str(out), self.dtype)
        except Exception as e:  # noqa: BLE001 (reported on every rank, like a sender's failure)
            error = f"trainer rank {self.rank}: writing the adapters to {out} failed: {type(e).__name__}: {e}"
        report.sender_errors = [e for e in gather_objects(error, self.group) if e]
        report.send_seconds = time.perf_counter() - start
        failed: dict[str, str] = {}
        if self.is_driver and not report.sender_errors:
            report.bytes_sent = (out / ADAPTER_FILE).stat().st_size
            failed = self._load(report.adapter, out)
            report.commit_seconds = time.perf_counter() - start - report.send_seconds
            if not path:
                prune_versions(self.root, max(KEEP_LOADED, self.config.keep_disk_versions))
        report.bytes_sent, report.commit_seconds, report.failed = self.broadcast_object(
            (report.bytes_sent, report.commit_seconds, failed)
        )
        if report.sender_errors:
            report.failed = {s.address: "the trainer did not write the adapters" for s in self.servers}
        report.updated = [s.address for s in self.servers if s.address not in report.failed]
        report.seconds = time.perf_counter() - start
        if report.ok:
            logger.info(
                "%d server(s) serve adapter %s (%.1f MB)", len(report.updated), report.adapter, report.bytes_sent / 1e6
            )
        else:
            logger.error("adapter update to version %d failed: %s %s", version, report.failed, report.sender_errors)
        return report

    def _load(self, name: str, path: Path) -> dict[str, str]:
        """Every server loads ``path`` as ``name``, then drops all but its newest :data:`KEEP_LOADED`;
        ``{address: why}`` of those that failed to load."""
        heartbeat.step(f"weight sync: {len(self.servers)} server(s) load adapter {name}")
        timeout = self.config.update_timeout
        calls = {
            s.address: (lambda s=s: s.load_adapter(name, str(path), replace=name in self._loaded.get(s.address, [])))
            for s in self.servers
        }
        failed = in_threads(calls, timeout)
        failed = {address: _with_hint(why) for address, why in failed.items()}
        for server in self.servers:
            if server.address in failed:
                continue
            held = [n for n in self._loaded.get(server.address, []) if n != name] + [name]
            for old in held[:-KEEP_LOADED]:
                try:
                    server.unload_adapter(old)
                except Exception as e:  # noqa: BLE001 (a restarted server holds none of the old ones)
                    logger.warning("server %s: unloading adapter %s: %s", server.address, old, e)
            self._loaded[server.address] = held[-KEEP_LOADED:]
        return failed

    def broadcast_object(self, value):
        """Rank 0's ``value`` on every trainer rank."""
        return rank0_object(value, self.group)

    def close(self) -> None:
        """Forget the servers (a restarted one is adopted again at the next :meth:`connect`)."""
        self.connected = False


def _with_hint(why: str) -> str:
    """A server's load failure, with what to check when the server does not serve LoRA at all."""
    if "HTTP 404" in why or "LoRA is not enabled" in why or "enable_lora" in why or "--enable-lora" in why:
        return (
            f"{why} (was the server started with LoRA enabled? vLLM needs --enable-lora and "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, SGLang --enable-lora; `megarl serve` adds them when "
            "weight_update.lora=adapter)"
        )
    return why
