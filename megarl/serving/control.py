"""The trainer's handle on one inference server: weight updates, LoRA adapters, probe scoring.

One implementation per server family, in the family's file beside its generation dialect
(:class:`megarl.serving.vllm.VLLMControl`, :class:`megarl.serving.sglang.SGLangControl`). Only
trainer rank 0 talks to servers. Calls that return only once the data has moved (``init_group``,
``receive``) run in a thread while the trainer ranks send; every call has a timeout and raises
:class:`~megarl.serving.http.ServerControlError` naming the server, the route and why.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass
from typing import Any

from megarl.api.io_struct import GenerationHyperparameters
from megarl.serving.backend import InferenceBackend
from megarl.serving.control_loop import control_loop
from megarl.serving.http import MalformedResponseError, ServerControlError, http_json, http_ok
from megarl.utils import json_codec

__all__ = ["ServerControl", "ServerControlError", "ServerRef", "http_json"]


@dataclass(frozen=True)
class ServerRef:
    """What every trainer rank knows of a server an update goes to: its family, address and TP size. Rank 0
    holds the server's :class:`ServerControl`, which says the same and calls it; the other ranks only form
    groups with it and send (the weight bridge reads these four fields on every rank)."""

    name: str
    address: str
    tp: int
    one_call_update: bool


class ServerControl(abc.ABC):
    """Trainer-side driver of one server: weight updates, LoRA adapters, probe scoring and sampling.

    A family's control class is its one client: :attr:`dialect` is the same family's generation dialect,
    which the rollout side speaks to every server of the family and :meth:`generate` speaks to this one.
    Calls that read the policy take the LoRA ``adapter`` to ask for (None: the base model):
    :attr:`ServerSet.adapter <megarl.serving.servers.ServerSet.adapter>` is the one the run serves.
    """

    name: str
    dialect: type[InferenceBackend]
    """The family's generation dialect (:class:`~megarl.serving.backend.InferenceBackend`)."""

    def __init__(self, address: str, tp: int, timeout: float = 600.0):
        self.address, self.tp, self.timeout = address, tp, timeout

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

    one_call_update = False
    """Whether :meth:`aupdate` does a whole update in one call (else :meth:`begin`, :meth:`receive`, :meth:`commit`)."""

    async def aupdate(self, connections, mode: str, path: str | None, version: int, on_paused, resume=False) -> None:
        """The whole update in one call on the trainer's control loop (:mod:`megarl.serving.control_loop`):
        pause, begin, receive, commit ``version`` (and with ``resume`` generate again); ``on_paused()`` once
        paused and begun. Families with :attr:`one_call_update` only."""
        raise NotImplementedError(f"{type(self).__name__} updates in three calls (begin, receive, commit)")

    def score(self, sequences: list[list[int]], adapter: str | None = None) -> list[list[float]]:
        """Logprob of every token but the first of each sequence, under the served weights (blocking:
        :meth:`ascore` on the control loop)."""
        return control_loop().run(self.ascore(sequences, adapter))

    @abc.abstractmethod
    async def ascore(self, sequences: list[list[int]], adapter: str | None = None) -> list[list[float]]:
        """:meth:`score` on the control loop (:mod:`megarl.serving.control_loop`): the probe asks every
        server at once there, over kept connections, with no thread per server."""

    def generate(self, prompt: list[int], max_tokens: int, seed: int, adapter: str | None = None) -> list[int]:
        """``prompt`` followed by ``max_tokens`` tokens sampled at temperature 1 (probe trajectories), asked
        in the family's :attr:`dialect`, as the rollout side asks."""
        dialect = self.dialect()
        gconfig = GenerationHyperparameters(max_new_tokens=max_tokens, min_new_tokens=max_tokens, seed=seed)
        body = dialect.generate_payload(list(prompt), gconfig, max_tokens, max_tokens, adapter)
        reply = http_json(self.address, dialect.generate_endpoint, body, self.timeout)
        try:
            chunk = dialect.parse_generate(reply)
        except MalformedResponseError as e:
            raise ServerControlError(self.address, dialect.generate_endpoint, str(e)) from None
        return list(prompt) + chunk.output_tokens

    @abc.abstractmethod
    def load_adapter(self, name: str, path: str, replace: bool = False) -> None:
        """Load the PEFT adapter directory ``path`` as the LoRA adapter ``name`` (``replace``: the server
        holds one of that name already, the same version pushed again); the server keeps the adapters
        loaded before."""

    @abc.abstractmethod
    def unload_adapter(self, name: str) -> None:
        """Drop the LoRA adapter ``name`` from the server."""

    def score_topk(
        self, sequences: list[list[int]], k: int, adapter: str | None = None
    ) -> list[list[dict[int, float]]] | None:
        """Per sequence, per token but the first: the ``k`` most likely tokens there and their logprobs
        (temperature 1, untruncated), most likely first; None where the server cannot say (blocking:
        :meth:`ascore_topk` on the control loop)."""
        return control_loop().run(self.ascore_topk(sequences, k, adapter))

    async def ascore_topk(
        self, sequences: list[list[int]], k: int, adapter: str | None = None
    ) -> list[list[dict[int, float]]] | None:
        """:meth:`score_topk` on the control loop."""
        return None

    async def aprobe(
        self, sequences: list[list[int]], k: int, adapter: str | None = None
    ) -> tuple[list[list[float]], list[list[dict[int, float]]] | None]:
        """What the consistency probe asks a server after an update: :meth:`ascore` of ``sequences`` and,
        with ``k`` > 0, :meth:`ascore_topk` (None where ``k`` is 0 or the server cannot say). A family whose
        server answers both in one request overrides this."""
        scores = await self.ascore(sequences, adapter)
        return scores, (await self.ascore_topk(sequences, k, adapter) if k > 0 else None)

    async def _ajson(self, route: str, payload: Any = None, method: str = "POST") -> Any:
        """``method`` ``route`` with the JSON ``payload`` over the control loop's connections (call on that
        loop); the decoded JSON reply. :class:`ServerControlError` names why it failed (within :attr:`timeout`)."""
        body = None if payload is None else json_codec.dumps(payload)
        deadline = asyncio.get_running_loop().time() + self.timeout
        try:
            reply = (
                await control_loop().connections().request(self.address, route, body, method=method, deadline=deadline)
            )
        except TimeoutError:
            raise ServerControlError(self.address, route, f"no reply within {self.timeout:g}s") from None
        except OSError as e:
            raise ServerControlError(self.address, route, f"unreachable: {type(e).__name__}: {e}") from None
        if reply.status != 200:
            raise ServerControlError(self.address, route, f"HTTP {reply.status}: {reply.text[:400]}")
        try:
            return json_codec.loads(reply.body)
        except ValueError:
            raise ServerControlError(self.address, route, f"reply is not JSON: {reply.body[:400]!r}") from None

    def healthy(self) -> bool:
        """Whether the server answers its health check."""
        return http_ok(self.address, "/health", timeout=5.0)
