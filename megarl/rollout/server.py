"""Moved to :mod:`megarl.serving.launch` (starting servers)."""

import megarl.serving.launch as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
