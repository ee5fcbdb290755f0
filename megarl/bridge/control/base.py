"""The control plane: how the trainer drives one inference server through an update.

One implementation per server family (:mod:`~megarl.bridge.control.vllm`,
:mod:`~megarl.bridge.control.sglang`). Only trainer rank 0 talks to servers. Calls that
return only once the data has moved (``init_group``, ``receive``) run in a thread while
the trainer ranks send; every call has a timeout and raises :class:`ServerControlError`
naming the server, the route and why.
"""

from __future__ import annotations

import abc
import json
import urllib.error
import urllib.request
from typing import Any

from megarl.utils.auth import auth_headers

_BODY_SNIPPET = 400


class ServerControlError(RuntimeError):
    """A control call to an inference server failed (unreachable, error reply, timeout)."""

    def __init__(self, address: str, route: str, reason: str):
        self.address, self.route, self.reason = address, route, reason
        super().__init__(f"inference server {address}{route}: {reason}")


def http_json(
    address: str, route: str, payload: Any = None, timeout: float = 60.0, method: str = "POST", text: bool = False
) -> Any:
    """``method`` ``http://address/route`` with a JSON body; the decoded JSON reply (None if empty), or
    with ``text`` the reply's text (routes that answer in plain text)."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        f"http://{address}{route}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **auth_headers()},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:_BODY_SNIPPET].decode(errors="replace")
        raise ServerControlError(address, route, f"HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
        raise ServerControlError(address, route, f"unreachable or timed out after {timeout:g}s ({e})") from None
    if text:
        return body.decode(errors="replace")
    try:
        return json.loads(body) if body.strip() else None
    except ValueError:
        raise ServerControlError(address, route, f"reply is not JSON: {body[:_BODY_SNIPPET]!r}") from None


class ServerControl(abc.ABC):
    """Trainer-side driver of one server's weight updates."""

    name: str

    def __init__(self, address: str, tp: int, timeout: float = 600.0):
        self.address, self.tp, self.timeout = address, tp, timeout
        self.adapter: str | None = None
        """The LoRA adapter the server serves the trainer's policy under (adapter weight sync): what
        :meth:`score` and :meth:`generate` ask for; None: the base model."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address}, tp={self.tp})"

    @abc.abstractmethod
    def init_group(self, init_info: dict) -> None:
        """Make the server's workers join the bridge groups (returns once they joined)."""

    @abc.abstractmethod
    def begin(self, mode: str) -> None:
        """Open an update of ``mode`` (the server is paused meanwhile)."""

    @abc.abstractmethod
    def receive(self, mode: str, path: str | None = None) -> None:
        """Make the workers receive one update (returns once everything arrived)."""

    @abc.abstractmethod
    def commit(self, version: int) -> None:
        """Apply what was received and record weight version ``version``."""

    @abc.abstractmethod
    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of every token but the first of each sequence, under the served weights."""

    @abc.abstractmethod
    def generate(self, prompt: list[int], max_tokens: int, seed: int) -> list[int]:
        """``prompt`` followed by ``max_tokens`` sampled tokens (probe trajectories)."""

    @abc.abstractmethod
    def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory ``path`` as the LoRA adapter ``name`` and serve the policy
        under it from now on (:attr:`adapter`); the server keeps the adapters loaded before."""

    @abc.abstractmethod
    def unload_adapter(self, name: str) -> None:
        """Drop the LoRA adapter ``name`` from the server."""

    def score_topk(self, sequences: list[list[int]], k: int) -> list[list[dict[int, float]]] | None:
        """Per sequence, per token but the first: the ``k`` most likely tokens there and their logprobs
        (temperature 1, untruncated), most likely first; None where the server cannot say."""
        return None

    def healthy(self) -> bool:
        try:
            http_json(self.address, "/health", method="GET", timeout=5.0)
        except ServerControlError:
            return False
        return True
