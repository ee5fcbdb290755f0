"""Old import paths of moved public names: they keep working and warn.

A module that moved leaves a shim at its old path::

    import megarl.run.saver as _moved_to
    from megarl.utils.deprecation import forward_to

    __getattr__ = forward_to(__name__, _moved_to)

``from megarl.utils.saver import Saver`` then gives ``megarl.run.saver.Saver`` itself, with a
:class:`DeprecationWarning` naming the new path. Nothing in megarl imports a shim
(``tests/test_layering.py`` checks it); the shims are removed in a later release, announced in
the changelog.

Only a documented path keeps a shim (the public API is what ``docs/name-mapping.md`` and the API
reference list); the warning names the release that removes it (:data:`REMOVED_IN`). An
undocumented module that moves just moves.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

REMOVED_IN = "0.2.0"
"""The release that removes today's shims."""


def forward_to(old: str, new: ModuleType, removed_in: str = REMOVED_IN) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the shim ``old``: every name is looked up in ``new``, with a warning
    naming the release ``removed_in`` that removes ``old``."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # the import machinery's own probes (__path__, __file__, ...)
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(new, name)
        _warn_moved(f"{old}.{name}", f"{new.__name__}.{name}", old, removed_in)
        return value

    return __getattr__


def moved_names(old: str, new: str, names: tuple[str, ...], removed_in: str = REMOVED_IN) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the names ``names`` that moved from the module ``old`` to the module
    ``new`` (imported on first use), each with a warning naming the release ``removed_in`` that removes
    the old path."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        _warn_moved(f"{old}.{name}", f"{new}.{name}", f"{old}.{name}", removed_in)
        return getattr(importlib.import_module(new), name)

    return __getattr__


def _warn_moved(old: str, new: str, removed: str, removed_in: str) -> None:
    """The warning of an old path ``old`` now at ``new``; ``removed`` (the old module or name) goes in
    ``removed_in``. ``stacklevel=3``: the line of the import that asked for it."""
    warnings.warn(
        f"{old} moved to {new}; import it from there ({removed} is removed in megarl {removed_in})",
        DeprecationWarning,
        stacklevel=3,
    )


def renamed_in(module: str, renames: dict[str, str], namespace: dict, removed_in: str = REMOVED_IN):
    """A module ``__getattr__`` for names of ``module`` that were renamed (``renames``: old -> new, the
    new ones in ``namespace``, the module's globals), each old name with a warning naming the release
    ``removed_in`` that removes it."""

    def __getattr__(name: str) -> Any:
        if name not in renames:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new = renames[name]
        warnings.warn(
            f"{module}.{name} is now {new} (megarl {removed_in} removes the old name)", DeprecationWarning, stacklevel=2
        )
        return namespace[new]

    return __getattr__
