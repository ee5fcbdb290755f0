"""The server families megarl speaks to, by the name a config gives them (``vllm``, ``sglang``)."""

from __future__ import annotations

from megarl.serving.backend import InferenceBackend
from megarl.serving.control import ServerControl, ServerRef
from megarl.serving.sglang import SGLangControl
from megarl.serving.vllm import VLLMControl

SERVER_FAMILIES: dict[str, type[ServerControl]] = {"vllm": VLLMControl, "sglang": SGLangControl}
"""Name -> the family's client: its control handle, whose ``dialect`` is its generation dialect."""


def _family(name: str) -> type[ServerControl]:
    if name not in SERVER_FAMILIES:
        raise ValueError(f"unknown inference backend {name!r}: expected one of {sorted(SERVER_FAMILIES)}")
    return SERVER_FAMILIES[name]


def make_backend(name: str) -> InferenceBackend:
    """The generation dialect of the backend called ``name`` (``"vllm"`` or ``"sglang"``)."""
    return _family(name).dialect()


def make_control(backend: str, address: str, tp: int, timeout: float = 600.0) -> ServerControl:
    """The trainer's handle on a ``backend`` (``vllm`` / ``sglang``) server at ``address`` with ``tp`` workers."""
    return _family(backend)(address, tp, timeout)


def server_ref(backend: str, address: str, tp: int) -> ServerRef:
    """What a trainer rank other than 0 knows of a ``backend`` server at ``address`` with ``tp`` workers."""
    return ServerRef(backend, address, tp, _family(backend).one_call_update)
