"""Moved to :mod:`megarl.bridge.transfer_plan` (the weight transfer plan; ``megarl.plan`` is the allocation planner)."""

import megarl.bridge.transfer_plan as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
