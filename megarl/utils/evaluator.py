"""Deprecated path: moved to :mod:`megarl.run.evaluator`. Its names still import from here, with a DeprecationWarning."""

import megarl.run.evaluator as _moved_to
from megarl.utils.deprecation import forward_to

__getattr__ = forward_to(__name__, _moved_to)
