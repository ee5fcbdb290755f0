"""The weight bridge: trainer weights (Megatron layout) -> TP-sharded vLLM / SGLang servers.

Pieces, each in its own module:

- ``transfer_plan`` / ``target_layout``: the pure transfer plan. Sources come from the model
  family's mapping (``megarl.models.mapping``), targets from vLLM's parallel layouts.
- ``schedule``: the plan cut into buckets, identically on both sides.
- ``groups`` / ``wiring``: the bridge's own process groups (NCCL on GPU, gloo on CPU),
  built on their own TCPStores beside the trainer's and the servers' groups.
- ``transport`` + ``transport_broadcast`` / ``transport_sharded`` / ``transport_disk``: the
  three modes behind one sender interface; receivers share ``receiver``.
- ``receivers.vllm``: the vLLM plugin / weight-transfer engine (runs inside vLLM).
- how the trainer drives each server family over HTTP is :mod:`megarl.serving` (``control`` here is
  the old path, kept with a warning).
- ``interface``: :class:`~megarl.bridge.interface.ServerBridge`, what the weight-sync phase drives.
- ``bridge``: :class:`WeightBridge`, the trainer side (connect once, update per step).
- ``adapter``: :class:`~megarl.bridge.adapter.AdapterBridge`, the same interface for LoRA adapter
  sync (the servers load each version's adapters as a LoRA adapter).
- ``consistency``: the probe logprob check (trainer vs servers).

The weight-sync phase that drives it each step (pause, transfer, version, resume, probe) is the
trainer loop's: :mod:`megarl.run.weight_sync`.
"""

from megarl.bridge.bridge import UpdateReport, WeightBridge, WeightBridgeError
from megarl.bridge.consistency import ConsistencyError, ConsistencyReport
from megarl.bridge.interface import ServerBridge
from megarl.bridge.transfer_plan import TransferPlan, build_plan

__all__ = [
    "ConsistencyError",
    "ConsistencyReport",
    "ServerBridge",
    "TransferPlan",
    "UpdateReport",
    "WeightBridge",
    "WeightBridgeError",
    "build_plan",
]
