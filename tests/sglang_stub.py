"""Import SGLang's request types on a CPU box: find the pinned copy, give ``torchvision`` an inert stand-in.

SGLang cannot serve on CPU; the contract checks use its request types only. ``make install``
puts SGLang 0.5.23 (its wheel as published, licence in its dist-info) into ``SGLANG_TYPES``
without its dependencies, outside the environment's packages: pip then has no CUDA-only
requirements of it to report as missing, and only these checks put it on ``sys.path``.
An SGLang installed in the environment (a GPU machine) is used when the copy is absent.

``sglang.srt.managers.io_struct`` imports torchvision indirectly, which ``make install`` removes
(the Makefile says why): tests give it an inert stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from unittest import mock

SGLANG_TYPES = Path(sys.prefix) / "sglang-types"  # the Makefile's `pip install --target`


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__, module.__version__ = [], spec, spec.name, "0.0.0"
        return module

    def exec_module(self, module):
        pass


def find_sglang() -> importlib.machinery.ModuleSpec | None:
    """Where ``sglang`` would be imported from (the pinned copy first), without importing it."""
    return importlib.machinery.PathFinder.find_spec("sglang", [str(SGLANG_TYPES)]) or importlib.util.find_spec("sglang")


def prepare_sglang() -> None:
    """Put the pinned copy first on ``sys.path`` and install the torchvision stand-in (idempotent)."""
    if SGLANG_TYPES.is_dir() and str(SGLANG_TYPES) not in sys.path:
        sys.path.insert(0, str(SGLANG_TYPES))
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
