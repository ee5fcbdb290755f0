"""Deprecated path: moved to :mod:`megarl.run.stats_logger`. Its names still import from here, with a DeprecationWarning."""

import megarl.run.stats_logger as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
