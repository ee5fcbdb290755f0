"""Moved to :mod:`megarl.serving.restarts` (the launcher's restart and join records)."""

import megarl.serving.restarts as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
