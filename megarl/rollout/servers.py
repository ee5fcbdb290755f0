"""Moved to :mod:`megarl.serving.servers` (the run's servers)."""

import megarl.serving.servers as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
