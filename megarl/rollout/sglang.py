"""Moved to :mod:`megarl.serving.sglang` (everything megarl says to an SGLang server)."""

import megarl.serving.sglang as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
