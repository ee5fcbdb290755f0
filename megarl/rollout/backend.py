"""Moved to :mod:`megarl.serving.backend` (the backends' generation dialect interface)."""

import megarl.serving.backend as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
