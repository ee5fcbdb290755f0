"""Shared utilities: stats tracking, logging setup, processes, networking.

``stats_tracker`` imports torch, so it is not imported here; use
``from megarl.utils import stats_tracker``.
"""

from megarl.utils.logging import get_logger, setup_logging
from megarl.utils.network import find_free_port, find_free_ports, gethostip
from megarl.utils.process import kill_on_exit, terminate_process_tree

__all__ = [
    "find_free_port",
    "find_free_ports",
    "get_logger",
    "gethostip",
    "kill_on_exit",
    "setup_logging",
    "terminate_process_tree",
]
