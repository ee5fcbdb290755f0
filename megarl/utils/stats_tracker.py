"""Training statistics with exact cross-rank reduction (AReaL's ``stats_tracker`` API).

Usage mirrors AReaL::

    stats_tracker.denominator(correct_seqs=rewards > 0)
    stats_tracker.stat(correct_seq_len=seqlens.float(), denominator="correct_seqs")
    with stats_tracker.scope("actor"), stats_tracker.record_timing("train_step"):
        stats_tracker.scalar(loss=0.25)            # key "actor/loss"
    stats = stats_tracker.export(reduce_group=dp_group)

Recording never synchronises with the device: each call folds its tensor into on-device
running sums / counts / minima / maxima. ``export`` packs every key into two vectors,
reduces them with two collectives (SUM and MIN, the maxima travel negated) and makes one
host transfer, so the global results are exact (sum of masked sums over sum of counts),
not means of per-rank means.

Scopes live in a ``contextvars.ContextVar`` so concurrent asyncio tasks (rollout
workflows) and threads each see their own scope stack.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.utils.host_tensors import host_list

logger = logging.getLogger(__name__)

_INF = float("inf")
_SMALL = 64
"""Host tensors up to this many elements are folded in with Python numbers (:meth:`_Acc._add_numbers`)."""


def _lower(acc: Any, v: float) -> Any:
    """min(acc, v), NaN winning, for an accumulator that is a number or a 0-dim tensor."""
    if isinstance(acc, torch.Tensor):
        return torch.minimum(acc, acc.new_tensor(v))
    return acc if (acc != acc or acc <= v) else v


def _upper(acc: Any, v: float) -> Any:
    """max(acc, v), NaN winning, for an accumulator that is a number or a 0-dim tensor."""
    if isinstance(acc, torch.Tensor):
        return torch.maximum(acc, acc.new_tensor(v))
    return acc if (acc != acc or acc >= v) else v


class ReduceType(enum.Enum):
    """How a key is aggregated over calls and ranks."""

    AVG_MIN_MAX = "avg_min_max"  # tensor stat: exports key/avg, key/min, key/max
    AVG = "avg"  # masked mean over all elements of all calls and ranks
    SUM = "sum"  # masked sum (denominators use this: the count of True elements)
    MIN = "min"
    MAX = "max"
    SCALAR = "scalar"  # python numbers: mean over all calls of all ranks


@dataclass
class _Acc:
    """Running aggregate of one key; fields are floats or 0-dim device tensors."""

    reduce_type: ReduceType
    denominator: str | None = None
    sum: Any = 0.0
    count: Any = 0.0
    min: Any = _INF
    max: Any = -_INF

    def add_tensor(self, value: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Fold the elements of ``value`` selected by ``mask`` (None: every one) in, without a host sync."""
        if value.numel() == 0:
            return
        if value.device.type == "cpu" and value.numel() <= _SMALL:
            self._add_numbers(host_list(value), itertools.repeat(True) if mask is None else host_list(mask))
            return
        if mask is None:
            mask = torch.ones_like(value, dtype=torch.bool)
        if not value.is_floating_point():
            value = value.double()  # integers cannot hold the +-inf fill values
        s = torch.where(mask, value, 0).sum(dtype=torch.float64)
        lo = torch.where(mask, value, _INF).min().double()
        hi = torch.where(mask, value, -_INF).max().double()
        self.sum = self.sum + s
        self.count = self.count + mask.sum(dtype=torch.float64)
        self.min = torch.minimum(torch.as_tensor(self.min, dtype=lo.dtype, device=lo.device), lo)
        self.max = torch.maximum(torch.as_tensor(self.max, dtype=hi.dtype, device=hi.device), hi)

    def _add_numbers(self, values: list, mask: Iterable) -> None:
        """:meth:`add_tensor` of a few host numbers, in Python: the rollout loop records a handful per
        episode, where each tensor operation would release the interpreter lock and wait for it again
        behind the trainer's Python (:mod:`megarl.utils.host_tensors`). NaN propagates as in the tensor
        path."""
        picked = [float(v) for v, m in zip(values, mask) if m]
        self.count = self.count + len(picked)
        for v in picked:
            self.sum = self.sum + v
            self.min = _lower(self.min, v)
            self.max = _upper(self.max, v)


class DistributedStatsTracker:
    """Collects scalars, masked tensor statistics and timings under hierarchical keys.

    Args:
        name: Optional prefix of every key this tracker records ("rollout" gives
            "rollout/..."); named trackers come from :func:`get`.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name.strip("/")
        self._lock = threading.RLock()
        self._scopes: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
            f"megarl_stats_scopes_{id(self)}", default=()
        )
        self._accs: dict[str, _Acc] = {}
        self._masks: dict[str, torch.Tensor] = {}  # latest mask of each denominator
        self._full_keys: dict[tuple[tuple[str, ...], str], str] = {}

    # ---------------------------------------------------------------- keys and scopes

    def _full_key(self, key: str) -> str:
        scopes = self._scopes.get()
        full = self._full_keys.get((scopes, key))
        if full is None:  # (the rollout loop records a few keys per episode, always in the same scopes)
            full = self._full_keys[(scopes, key)] = "/".join(p for p in (self.name, *scopes, key) if p)
        return full

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix keys recorded inside the block with ``name/`` (scopes nest)."""
        token = self._scopes.set(self._scopes.get() + (name.strip("/"),))
        try:
            yield
        finally:
            self._scopes.reset(token)

    def scope_func_wrapper(self, name: str) -> Callable[[Callable], Callable]:
        """Decorator running the wrapped function inside ``scope(name)``."""

        def decorator(func: Callable) -> Callable:
            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                with self.scope(name):
                    return func(*args, **kwargs)

            return wrapper

        return decorator

    @contextmanager
    def record_timing(self, name: str) -> Iterator[None]:
        """Record the block's wall time in seconds under ``timeperf/<scopes>/<name>``.

        Timings all live below ``timeperf/`` so loggers can group them. On GPUs the
        caller decides whether to synchronise before the block ends.
        """
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._add_scalar("timeperf/" + self._full_key(name), elapsed)

    # ------------------------------------------------------------------- recording

    def _acc(self, key: str, reduce_type: ReduceType, denominator: str | None = None) -> _Acc:
        acc = self._accs.get(key)
        if acc is None:
            acc = self._accs[key] = _Acc(reduce_type, denominator)
        elif acc.reduce_type != reduce_type or acc.denominator != denominator:
            raise ValueError(
                f"stats key {key!r} was recorded as ({acc.reduce_type.name}, denominator="
                f"{acc.denominator!r}) and now as ({reduce_type.name}, denominator={denominator!r})"
            )
        return acc

    def scalar(self, **values: float | torch.Tensor) -> None:
        """Record numbers; export gives their mean over all calls (and ranks)."""
        with self._lock:
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    if value.numel() != 1:
                        raise ValueError(f"scalar {key!r} needs one element, got shape {tuple(value.shape)}")
                    value = value.detach().double().reshape(())  # stays on device
                else:
                    value = float(value)
                self._add_scalar(self._full_key(key), value)

    def _add_scalar(self, full_key: str, value: float | torch.Tensor) -> None:
        acc = self._acc(full_key, ReduceType.SCALAR)
        acc.sum = acc.sum + value
        acc.count += 1

    def denominator(self, **masks: torch.Tensor) -> None:
        """Record bool masks; each names a denominator for :meth:`stat`.

        Exported as the number of True elements (summed over calls and ranks).
        """
        with self._lock:
            for key, mask in masks.items():
                if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                    got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
                    raise ValueError(f"denominator {key!r} must be a bool tensor, got {got}")
                full_key = self._full_key(key)
                self._acc(full_key, ReduceType.SUM).add_tensor(mask)  # every element counts; a bool carries no gradient
                self._masks[full_key] = mask

    def stat(
        self,
        denominator: str,
        reduce_type: ReduceType | None = None,
        **tensors: torch.Tensor,
    ) -> None:
        """Record tensors, aggregated over the elements where ``denominator`` is True.

        Each tensor pairs with the latest mask recorded under ``denominator`` (resolved
        in the current scope) and must have its shape. The default ``AVG_MIN_MAX``
        exports ``key/avg``, ``key/min`` and ``key/max``.
        """
        reduce_type = ReduceType.AVG_MIN_MAX if reduce_type is None else reduce_type
        if not isinstance(reduce_type, ReduceType) or reduce_type == ReduceType.SCALAR:
            raise ValueError(f"stat reduce_type must be a tensor ReduceType, got {reduce_type!r}")
        with self._lock:
            denom_key = self._full_key(denominator)
            mask = self._masks.get(denom_key)
            for key, value in tensors.items():
                full_key = self._full_key(key)
                if mask is None:
                    raise ValueError(
                        f"stat {full_key!r}: denominator {denom_key!r} was not recorded; "
                        f"call denominator({denominator}=...) first"
                    )
                _check_stat_tensor(full_key, value, denom_key, mask)
                self._acc(full_key, reduce_type, denom_key).add_tensor(value.detach(), mask)

    # --------------------------------------------------------------------- export

    def export(
        self,
        key: str | None = None,
        reduce_group: dist.ProcessGroup | None = None,
        reset: bool = True,
        *,
        local: bool = False,
    ) -> dict[str, float]:
        """Aggregate the recorded stats (one key, resolved in the current scope, or all).

        When torch.distributed is initialized this is a collective over
        ``reduce_group`` (default: the world group) that every member must call;
        keys recorded on only some ranks are fine. ``local=True`` skips the reduction.
        ``reset`` drops what was exported. Keys with nothing to report (a mean over
        zero elements) are left out.
        """
        group = None if local else _resolve_group(reduce_group)
        with self._lock:
            wanted = None if key is None else self._full_key(key)
            meta = {k: (a.reduce_type, a.denominator) for k, a in self._accs.items() if wanted is None or k == wanted}
            if group is not None:
                meta = _merge_meta(meta, group)
            keys = sorted(meta)
            sums, mins = self._pack(keys, meta, _reduce_device(group))
            if group is not None:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
                dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)
            result = _unpack(keys, meta, sums.tolist(), mins.tolist())
            if reset:
                self._drop(keys)
        return result

    def _pack(self, keys: list[str], meta: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Lay out [sum, count] per key for SUM and [min, -max] per key for MIN."""
        sums, mins = [], []
        for key in keys:
            acc = self._accs.get(key) or _Acc(*meta[key])  # absent here: identity values
            sums += [acc.sum, acc.count]
            mins += [acc.min, -acc.max]
        return _stack(sums, device), _stack(mins, device)

    def _drop(self, keys: list[str]) -> None:
        for key in keys:
            self._accs.pop(key, None)
            self._masks.pop(key, None)


def _check_stat_tensor(key: str, value: Any, denom_key: str, mask: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or value.is_complex():
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"stat {key!r} must be a real-valued tensor, got {got}")
    if value.shape != mask.shape:
        raise ValueError(
            f"stat {key!r} has shape {tuple(value.shape)} but its denominator "
            f"{denom_key!r} has shape {tuple(mask.shape)}"
        )


def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group to reduce over, or None when there is nothing to reduce with."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def _reduce_device(group: dist.ProcessGroup | None) -> torch.device:
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _stack(values: list, device: torch.device) -> torch.Tensor:
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([torch.as_tensor(v, dtype=torch.float64).to(device) for v in values])


def _merge_meta(meta: dict, group: dist.ProcessGroup) -> dict:
    """Union of every rank's {key: (reduce_type, denominator)}; conflicts are errors."""
    gathered: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, meta, group=group)
    merged: dict = {}
    for key, kind in itertools.chain.from_iterable(m.items() for m in gathered):
        if merged.setdefault(key, kind) != kind:
            raise ValueError(f"stats key {key!r} is recorded differently across ranks: {merged[key]} vs {kind}")
    return merged


def _unpack(keys: list[str], meta: dict, sums: list[float], mins: list[float]) -> dict[str, float]:
    result: dict[str, float] = {}
    for i, key in enumerate(keys):
        total, count = sums[2 * i], sums[2 * i + 1]
        lo, hi = mins[2 * i], -mins[2 * i + 1]
        reduce_type = meta[key][0]
        mean = total / count if count > 0 else None
        if reduce_type == ReduceType.AVG_MIN_MAX:
            if count > 0:
                result.update({f"{key}/avg": mean, f"{key}/min": lo, f"{key}/max": hi})
        elif reduce_type in (ReduceType.AVG, ReduceType.SCALAR):
            if mean is not None:
                result[key] = mean
        elif reduce_type == ReduceType.SUM:
            result[key] = total
        elif count > 0:  # MIN / MAX over at least one element
            result[key] = lo if reduce_type == ReduceType.MIN else hi
    return result


# A process-wide registry is what makes ``stats_tracker.scalar(...)`` usable from any
# module, as in AReaL; it is the only module state here.
_DEFAULT_TRACKER = DistributedStatsTracker()
_TRACKERS: dict[str, DistributedStatsTracker] = {"": _DEFAULT_TRACKER}
_TRACKERS_LOCK = threading.Lock()


def get(name: str = "") -> DistributedStatsTracker:
    """The tracker called ``name`` (created on first use; "" is the default one)."""
    with _TRACKERS_LOCK:
        if name not in _TRACKERS:
            _TRACKERS[name] = DistributedStatsTracker(name)
        return _TRACKERS[name]


def export_all(
    reduce_group: dist.ProcessGroup | None = None, reset: bool = True, *, local: bool = False
) -> dict[str, float]:
    """Export every tracker (collective like :meth:`DistributedStatsTracker.export`)."""
    with _TRACKERS_LOCK:
        names = sorted(_TRACKERS)
    group = None if local else _resolve_group(reduce_group)
    if group is not None:
        gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, names, group=group)
        names = sorted(set(itertools.chain.from_iterable(gathered)))
    result: dict[str, float] = {}
    for name in names:
        stats = get(name).export(reduce_group=reduce_group, reset=reset, local=local)
        duplicates = result.keys() & stats.keys()
        if duplicates:
            logger.warning("stats keys exported by several trackers: %s", sorted(duplicates))
        result.update(stats)
    return result


scalar = _DEFAULT_TRACKER.scalar
denominator = _DEFAULT_TRACKER.denominator
stat = _DEFAULT_TRACKER.stat
scope = _DEFAULT_TRACKER.scope
scope_func_wrapper = _DEFAULT_TRACKER.scope_func_wrapper
record_timing = _DEFAULT_TRACKER.record_timing
export = _DEFAULT_TRACKER.export
