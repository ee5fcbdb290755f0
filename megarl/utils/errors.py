"""The error every check of a user's input raises: a wrong value, named by its dotted key.

Config dataclasses raise it from their ``check()`` (through :func:`require`), and so do the
other places that judge what a config names (plug-in paths, pre-launch checks):
``megarl.config.base.validate_tree`` prefixes its key with the path of the config holding it.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value that is wrong; ``key`` is its full dotted path.

    ``related`` names other keys (full paths) whose values the check weighed, e.g.
    ``allocation_mode`` for a batch size that must split over its data-parallel ranks:
    the loader says which file set each of them.
    """

    def __init__(self, key: str, message: str, related: tuple[str, ...] = ()):
        self.key = key
        self.message = message
        self.related = related
        super().__init__(f"config error at '{key}': {message}" if key else f"config error: {message}")

    def under(self, prefix: str) -> ConfigError:
        """The same error with ``prefix.`` prepended to its key path."""
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.message, self.related)


def require(condition: bool, key: str, value: Any, why: str, related: tuple[str, ...] = ()) -> None:
    """Raise ``ConfigError(key, ...)`` naming ``value`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(key, f"{value!r} is invalid: {why}", related)
