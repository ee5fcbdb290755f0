"""The server families megarl speaks to, by the name a config gives them (``vllm``, ``sglang``)."""

from __future__ import annotations

from megarl.serving.backend import InferenceBackend
from megarl.serving.control import ServerControl
from megarl.serving.sglang import SGLangBackend, SGLangControl
from megarl.serving.vllm import VLLMBackend, VLLMControl

SERVER_FAMILIES: dict[str, tuple[type[InferenceBackend], type[ServerControl]]] = {
    "vllm": (VLLMBackend, VLLMControl),
    "sglang": (SGLangBackend, SGLangControl),
}
"""Name -> (its generation dialect, its control handle)."""


def _family(name: str) -> tuple[type[InferenceBackend], type[ServerControl]]:
    if name not in SERVER_FAMILIES:
        raise ValueError(f"unknown inference backend {name!r}: expected 'vllm' or 'sglang'")
    return SERVER_FAMILIES[name]


def make_backend(name: str) -> InferenceBackend:
    """The generation dialect of the backend called ``name`` (``"vllm"`` or ``"sglang"``)."""
    return _family(name)[0]()


def make_control(backend: str, address: str, tp: int, timeout: float = 600.0) -> ServerControl:
    """The trainer's handle on a ``backend`` (``vllm`` / ``sglang``) server at ``address`` with ``tp`` workers."""
    return _family(backend)[1](address, tp, timeout)
