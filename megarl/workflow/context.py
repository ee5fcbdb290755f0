"""Deprecated path: moved to :mod:`megarl.api.context`. Its names still import from here, with a DeprecationWarning."""

import megarl.api.context as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
