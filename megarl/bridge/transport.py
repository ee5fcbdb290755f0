"""The interface every transport implements, and the flat-buffer packing they share.

One file per implementation: :mod:`~megarl.bridge.transport_broadcast` (full HF tensors
to every worker), :mod:`~megarl.bridge.transport_sharded` (each worker only its slices),
:mod:`~megarl.bridge.transport_disk` (HF safetensors written in parallel). A sender runs
on every trainer rank (all of them call :meth:`TransportSender.send`, collectives
inside); a receiver runs in each inference worker and yields what arrives, bucket by
bucket, while the next bucket is already on the wire.
"""

from __future__ import annotations

import abc
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``bfloat16``, ``float16``, ``float32``)."""
    if name not in DTYPES:
        raise ValueError(f"weight transfer dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class TransferStats:
    """What one rank moved in one update."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    seconds: float = 0.0
    pack_seconds: float = 0.0
    """Time spent gathering / converting / packing (overlapped with the wire when pipelined)."""
    error: str = ""
    """Why this rank's sending failed (empty: it did not)."""
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "messages": self.messages,
            "seconds": self.seconds,
            "pack_seconds": self.pack_seconds,
            "error": self.error,
            **self.extra,
        }


class ReceiveBuffers:
    """A worker's receive buffers, kept from one update to the next where ``keep`` (one per message key).

    A CPU worker's new buffer is fresh pages, which the kernel maps and zeroes as the bytes arrive:
    slower than arriving into pages already mapped (``docs/development.md``, "The weight sync into kept
    pages"). A staged update holds every buffer of the
    update at once anyway (``ReceiverInit.stage``), so keeping them costs no memory beyond that peak.
    Buffers are reused across updates only, never within one: what a receiver yields stays valid
    until the update is applied.
    """

    def __init__(self, keep: bool):
        self.keep = keep
        self._kept: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """The buffer for message ``key`` of an update: last update's if kept and alike, else a new one."""
        buf = self._kept.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != torch.device(device):
            buf = torch.empty(numel, dtype=dtype, device=device)
            if self.keep:
                self._kept[key] = buf
        return buf

    def drop(self) -> None:
        """Forget the kept buffers (after a failed update: a receive still posted may write into one)."""
        self._kept = {}

    @property
    def kept(self) -> dict[tuple, torch.Tensor]:
        """The kept buffers by message key."""
        return dict(self._kept)


class TransportSender(abc.ABC):
    """Trainer side of one mode: every trainer rank calls :meth:`send` once per update."""

    mode: str

    @abc.abstractmethod
    def send(self, source) -> TransferStats:
        """Send this rank's part of the weights (``source``: a :class:`~megarl.bridge.source.ShardSource`)."""

    def close(self) -> None:
        """Release groups and buffers (default: nothing)."""


def pack(tensors: Iterable[torch.Tensor], numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``tensors`` flattened back to back into one new buffer of ``numel`` elements of ``dtype``."""
    buf = torch.empty(numel, dtype=dtype, device=device)
    offset = 0
    for t in tensors:
        n = t.numel()
        buf[offset : offset + n].view(t.shape).copy_(t)  # converts dtype and makes strided slices contiguous
        offset += n
    if offset != numel:
        raise AssertionError(f"packed {offset} elements into a bucket of {numel}")
    return buf


def unpack(buf: torch.Tensor, shapes: Iterable[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of ``buf`` with ``shapes``, back to back (the inverse of :func:`pack`)."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(buf[offset : offset + n].view(shape))
        offset += n
    if offset != buf.numel():
        raise AssertionError(f"a bucket of {buf.numel()} elements holds {offset}")
    return out


class Timer:
    """Accumulates seconds over ``with timer:`` blocks."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self._start
