"""Moved to :mod:`megarl.serving.http` (HTTP to the servers: sessions, retries, errors)."""

import megarl.serving.http as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
