"""The weight-sync phase drives one declared interface (``megarl.bridge.interface.ServerBridge``): the whole
model's bridge and the LoRA adapters' both declare it, with its signatures."""

from __future__ import annotations

import inspect

import pytest

from megarl.bridge import ServerBridge
from megarl.bridge.adapter import AdapterBridge
from megarl.bridge.bridge import WeightBridge


@pytest.mark.parametrize("bridge", [WeightBridge, AdapterBridge])
def test_each_bridge_declares_the_interface_with_its_signatures(bridge):
    assert issubclass(bridge, ServerBridge) and not inspect.isabstract(bridge)
    for name in ("connect", "update", "broadcast_object", "close"):
        declared = inspect.signature(getattr(ServerBridge, name))
        assert list(inspect.signature(getattr(bridge, name)).parameters) == list(declared.parameters), name


def test_a_bridge_without_a_method_of_the_interface_cannot_be_made():
    class HalfBridge(ServerBridge):
        is_driver = True

        def connect(self, servers):
            pass

    with pytest.raises(TypeError, match="abstract"):
        HalfBridge()
