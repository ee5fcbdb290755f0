"""Validation plumbing shared by every config dataclass.

Each config dataclass may define ``check(self)`` that raises :class:`ConfigError`
via :func:`require` for its own fields; :func:`validate_tree` walks a whole config,
calls every ``check`` and prefixes errors with the full key path
(``actor.optimizer.lr``), so a message always names the key and the bad value.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megarl.utils.errors import ConfigError, require

__all__ = ["ConfigError", "require", "validate_tree"]


def validate_tree(config: Any, prefix: str = "") -> None:
    """Call ``check()`` on ``config`` and every nested config dataclass, depth first.

    Before any ``check``, every float of the tree must be finite: an infinite learning rate or
    a NaN clip passes most range checks and fails (or trains on nonsense) only later.
    """
    if not dataclasses.is_dataclass(config):
        return
    for f in dataclasses.fields(config):
        child = getattr(config, f.name)
        path = f"{prefix}.{f.name}" if prefix else f.name
        _require_finite(child, path)
        children = child if isinstance(child, (list, tuple)) else [child]
        for i, item in enumerate(children):
            validate_tree(item, f"{path}[{i}]" if child is not item else path)
    check = getattr(config, "check", None)
    if check is None:
        return
    try:
        check()
    except ConfigError as err:
        raise (err.under(prefix) if prefix else err) from None


def _require_finite(value: Any, path: str) -> None:
    values = value if isinstance(value, (list, tuple)) else [value]
    for i, item in enumerate(values):
        if isinstance(item, float) and not math.isfinite(item):
            key = f"{path}[{i}]" if values is value else path
            raise ConfigError(key, f"{item!r} is invalid: must be a finite number (null where a bound is optional)")
