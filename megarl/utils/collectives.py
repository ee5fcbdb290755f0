"""Which ``torch.distributed`` collective this process is in, for its heartbeat.

A rank that never reaches a collective leaves the others waiting in it, and from the outside
all of them are silent. :class:`CollectiveTrace` wraps the blocking collectives of
``torch.distributed`` (``all_reduce``, ``broadcast``, ``barrier``, the ``*_object`` ones, ...) so
that, while one runs, the process knows ``{"op", "ranks", "backend", "seq", "since"}``: the
operation, the global ranks of its group, and how many collectives this process has entered on
that group before (SPMD ranks enter the same ones in the same order, so equal ``seq`` means the
same call). The heartbeat writes it at each beat; the watchdog (:mod:`megarl.launcher.watchdog`)
groups the ranks waiting in one call and names the ranks of its group that have not arrived.

Asynchronous calls (``async_op=True``, e.g. Megatron's overlapped gradient reduction) are not
traced: they return at once and are waited on elsewhere (on CUDA, NCCL's flight recorder keeps
them). Only calls made through the ``torch.distributed`` namespace are seen, which is how
Megatron-Core and megarl call them.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections import defaultdict
from typing import Any

import torch.distributed as dist

TRACED = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send",
    "recv",
)


class CollectiveTrace:
    """The collective running in this process now (:attr:`current`), kept by wrappers :meth:`install` puts in place."""

    def __init__(self):
        self.current: dict[str, Any] | None = None
        self._seq: dict[tuple[int, ...], int] = defaultdict(int)
        self._local = threading.local()  # depth: an *_object collective calls plain ones inside
        self._originals: dict[str, Any] = {}

    def install(self) -> CollectiveTrace:
        for name in TRACED:
            original = getattr(dist, name, None)
            if original is not None and name not in self._originals:
                self._originals[name] = original
                setattr(dist, name, self._wrap(name, original))
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
        self.current = None

    def _wrap(self, name: str, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if getattr(self._local, "depth", 0) or kwargs.get("async_op"):
                return fn(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs).arguments
            if bound.get("async_op"):
                return fn(*args, **kwargs)
            self._enter(name, bound.get("group"))
            self._local.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = 0
                self.current = None

        return traced

    def _enter(self, op: str, group) -> None:
        try:
            group = group if group is not None else dist.group.WORLD
            ranks = tuple(dist.get_process_group_ranks(group))
            backend = str(dist.get_backend(group))
        except (RuntimeError, ValueError, AttributeError, KeyError):  # not initialised, or not a group: torch says so
            ranks, backend = (), "?"
        self._seq[ranks] += 1
        self.current = {
            "op": op,
            "ranks": list(ranks),
            "backend": backend,
            "seq": self._seq[ranks],
            "since": time.time(),
        }


def describe(collective: dict[str, Any]) -> str:
    """``all_reduce #17 (gloo, ranks 0,1,2)``."""
    ranks = ",".join(map(str, collective["ranks"]))
    return f"{collective['op']} #{collective['seq']} ({collective['backend']}, ranks {ranks})"


def same_call(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two heartbeats' collectives are the same call of the same group."""
    return a is not None and b is not None and (a["op"], a["ranks"], a["seq"]) == (b["op"], b["ranks"], b["seq"])
