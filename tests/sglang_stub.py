"""Import SGLang's request types on a CPU box: give ``torchvision`` an inert stand-in.

``sglang.srt.managers.io_struct`` imports torchvision indirectly; the only torchvision
on PyPI is a CUDA build that breaks this torch, so tests stub it instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from unittest import mock


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


def stub_torchvision() -> None:
    """Install the stand-in once (idempotent)."""
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
