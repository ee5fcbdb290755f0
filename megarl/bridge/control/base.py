"""Moved to :mod:`megarl.serving.control` (the trainer's handle on one server)."""

import megarl.serving.control as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
