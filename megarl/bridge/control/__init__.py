"""Trainer-side drivers of the servers' weight-update APIs: one file per server family."""

from megarl.bridge.control.base import ServerControl, ServerControlError, http_json

__all__ = ["ServerControl", "ServerControlError", "http_json", "make_control"]


def make_control(backend: str, address: str, tp: int, timeout: float = 600.0) -> ServerControl:
    """The driver of a ``backend`` (``vllm`` / ``sglang``) server at ``address`` with ``tp`` workers."""
    if backend == "vllm":
        from megarl.bridge.control.vllm import VLLMControl

        return VLLMControl(address, tp, timeout)
    if backend == "sglang":
        from megarl.bridge.control.sglang import SGLangControl

        return SGLangControl(address, tp, timeout)
    raise ValueError(f"unknown inference backend {backend!r}: expected 'vllm' or 'sglang'")
