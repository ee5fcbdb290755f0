"""Moved to :mod:`megarl.serving.vllm` (everything megarl says to a vLLM server)."""

import megarl.serving.vllm as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
