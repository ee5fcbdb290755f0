"""Generation on the servers: ``agenerate``, what a workflow calls, interruptible and stamped with versions.

``agenerate`` is interruptible: when a weight update pauses the servers, a request comes back with
``finish_reason == "abort"`` and the tokens so far; it waits until the client is resumed and is
sent again with those tokens appended to the prompt (to the same server, whose prefix cache holds
them), until it stops or its token budget is spent. Each token is stamped with the weight version
current when its chunk was sent (a chunk never spans a weight update: the update aborts it first).

Around dead servers: a request that has no token yet is re-issued elsewhere, one that has some fails
its episode (:class:`ServerLostError`: the pool runs it again from scratch), so that no sample is half
from a server that died. Under a launcher that restarts servers every such request fails its episode:
no episode keeps samples from before a server's death beside samples from after it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from megarl.api import context as workflow_context
from megarl.api.engine_api import GenerationEngine
from megarl.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse, derive_seed
from megarl.config.rollout import InferenceEngineConfig
from megarl.rollout.gate import Gate
from megarl.serving.backend import GenerationChunk, InferenceBackend, check_chunk
from megarl.serving.http import (
    InferenceServerError,
    RetryPolicy,
    ServerUnavailableError,
    arequest_with_retry,
)
from megarl.serving.kept_http import LoopConnections
from megarl.serving.servers import NoHealthyServerError, Server, ServerSet
from megarl.utils import stats_tracker
from megarl.utils.heartbeat import InFlight

_RESTART_POLL_S = 0.5


class ServerLostError(InferenceServerError):
    """A server became unreachable while a sample was half generated on it: the episode must run again."""

    def __init__(self, address: str, reason: str):
        super().__init__(address, "", reason, kind="server_lost")


class GenerationClient(GenerationEngine):
    """``agenerate`` over a :class:`ServerSet`: what the rollout pool hands to ``arun_episode`` as its engine.

    Args:
        config: The ``rollout`` section (retries, timeouts, pause grace period).
        backend: Builds the generation payloads and parses the replies.
        servers: Routes each request.
        max_connections: Open connections per event loop.
        tokenizer: Handed to workflows that render chats with the engine's tokenizer.
    """

    def __init__(
        self,
        config: InferenceEngineConfig,
        backend: InferenceBackend,
        servers: ServerSet,
        max_connections: int = 64,
        tokenizer: Any = None,
    ):
        self.config = config
        self.backend = backend
        self.servers = servers
        self.policy = RetryPolicy(config.request_timeout, config.request_retries, config.retry_backoff)
        self.tokenizer = tokenizer
        self._gate = Gate()  # closed while paused; released once stopped
        self._version = 0
        self._connections = LoopConnections(max_connections)
        self._requests = InFlight("request(s) outstanding")  # by server, for the watchdog

    @property
    def paused(self) -> bool:
        """While True, requests wait before they are sent (set around a weight update)."""
        return self._gate.closed

    @paused.setter
    def paused(self, value: bool) -> None:
        self._gate.close() if value else self._gate.open()

    @property
    def stopped(self) -> bool:
        """Once True, an aborted request returns what it has instead of waiting for a resume."""
        return self._gate.released

    @stopped.setter
    def stopped(self, value: bool) -> None:
        if not value:
            raise ValueError("a stopped GenerationClient stays stopped")
        self._gate.release()

    @property
    def server_addresses(self) -> list[str]:
        """Every server's ``host:port`` (a trajectory's ``server_index`` indexes this list)."""
        return self.servers.addresses

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    def describe_outstanding(self) -> str:
        """The generation requests waiting for a server now, by server, oldest first (for the watchdog)."""
        return self._requests.describe()

    # ------------------------------------------------------------------ connections

    async def aclose(self) -> None:
        """Close the running loop's connections (the pool calls this when it stops)."""
        self._connections.close_here()

    # ------------------------------------------------------------------ generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one sample, continuing across pauses and re-issuing around dead servers."""
        start = time.perf_counter()
        gconfig = req.gconfig
        resp = ModelResponse(input_tokens=list(req.input_ids), tokenizer=req.tokenizer)
        stalled = 0  # consecutive aborts that brought no token while not paused
        outages = 0  # times every server was out of rotation
        restart_deadline = time.monotonic() + self.config.setup_timeout
        while True:
            await self._wait_while_paused()
            remaining = gconfig.max_new_tokens - resp.output_len
            if remaining <= 0:
                resp.stop_reason = "length"
                break
            try:
                server = self.servers.choose(req.rid)
            except NoHealthyServerError:
                # under a launcher that restarts servers, a restarted (or joined) one comes back once the trainer
                # pushed; a dead one may not be recorded yet (the update that found it dead took it out of rotation)
                if self.servers.restartable and time.monotonic() < restart_deadline:
                    await asyncio.sleep(_RESTART_POLL_S)
                    continue
                outages += 1
                if outages > self.policy.retries or not await self.servers.wait_for_a_server():
                    raise
                continue
            if resp.output_tokens and server.address != resp.server:  # its own server is out of rotation
                raise ServerLostError(resp.server, "out of rotation with a sample half generated on it")
            version = self._version
            payload = self.backend.generate_payload(
                resp.input_tokens + resp.output_tokens,
                _continuation(gconfig, resp.output_tokens),
                remaining,
                max(0, gconfig.min_new_tokens - resp.output_len),
                self.servers.adapter,
            )
            try:
                chunk = await self._send(server, payload, remaining)
            except ServerUnavailableError as e:
                self.servers.mark_failed(server, e)
                # never half a sample from a server that died: the episode runs again; under a launcher that
                # restarts servers, nor half an episode: its finished samples are not kept either
                if resp.output_tokens or self.servers.restartable:
                    raise ServerLostError(server.address, f"unreachable: {e}") from e
                continue  # nothing generated yet: another server
            if not resp.ttft:
                resp.ttft = time.perf_counter() - start
            resp.server = server.address
            _append(resp, chunk, version, remaining)
            if chunk.finish_reason != "abort" or self.stopped:
                resp.stop_reason = chunk.finish_reason
                break
            resp.n_interruptions += 1
            stalled = 0 if (chunk.output_tokens or self.paused) else stalled + 1
            if stalled > self.policy.retries:
                raise InferenceServerError(
                    server.address,
                    self.backend.generate_endpoint,
                    "the server keeps aborting the request without pausing",
                    stalled,
                )
            await asyncio.sleep(self.config.pause_grace_period)
        resp.latency = time.perf_counter() - start
        workflow_context.note_server(resp.server)
        stats_tracker.scalar(
            generate_latency_s=resp.latency, generate_ttft_s=resp.ttft, generate_interruptions=resp.n_interruptions
        )
        return resp

    async def _wait_while_paused(self) -> None:
        await self._gate.wait()

    async def _send(self, server: Server, payload: dict[str, Any], max_tokens: int) -> GenerationChunk:
        server.in_flight += 1
        try:
            with self._requests.track(server.address, workflow_context.get().task_id):
                return await arequest_with_retry(
                    self._connections.here(),
                    server.address,
                    self.backend.generate_endpoint,
                    payload,
                    policy=self.policy,
                    parse=lambda body: check_chunk(
                        self.backend.parse_generate(body), max_tokens, self.backend.vocab_size
                    ),
                    give_up=lambda: not server.usable(time.monotonic()),
                    hold=self._gate.wait,
                )
        finally:
            server.in_flight -= 1


def _append(resp: ModelResponse, chunk: GenerationChunk, version: int, remaining: int) -> None:
    """Add a chunk's tokens, logprobs and routed experts to ``resp``, each token stamped with ``version``."""
    if len(chunk.output_tokens) > remaining:
        raise InferenceServerError(
            resp.server, "", f"{len(chunk.output_tokens)} tokens for a budget of {remaining}", kind="malformed"
        )
    if chunk.prompt_routed_experts is not None and not resp.output_tokens and resp.input_routed_experts is None:
        resp.input_routed_experts = chunk.prompt_routed_experts  # a continuation's input repeats earlier answers
    resp.output_tokens += chunk.output_tokens
    resp.output_logprobs += chunk.output_logprobs
    if chunk.routed_experts is not None:
        resp.output_routed_experts = (resp.output_routed_experts or []) + chunk.routed_experts
    resp.output_versions += [version] * len(chunk.output_tokens)


def _continuation(gconfig: GenerationHyperparameters, generated: list[int]) -> GenerationHyperparameters:
    """A continued sample (after a pause) draws fresh seeded randomness, still reproducibly."""
    if gconfig.seed is None or not generated:
        return gconfig
    return gconfig.new(seed=derive_seed(gconfig.seed, generated, len(generated)))
