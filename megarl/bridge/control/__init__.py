"""Moved to :mod:`megarl.serving` (the inference servers)."""

import megarl.serving as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
