"""The remote inference engine: the ``InferenceEngine`` API over HTTP inference servers.

``agenerate`` is interruptible: when a weight update pauses the servers, a request comes
back with ``finish_reason == "abort"`` and the tokens so far; it waits until the engine
is resumed and is sent again with those tokens appended to the prompt (to the same
server, whose prefix cache holds them), until it stops or its token budget is spent.
Each token is stamped with the weight version current when its chunk was sent (a
chunk never spans a weight update: the update aborts it first).

Routing: requests sharing a ``rid`` stick to one server; others go to the least-loaded
(or next, round-robin) healthy server. A server unreachable after all retries is
marked unhealthy for ``unhealthy_retry_interval`` seconds; a request that has no token yet is
re-issued elsewhere, one that has some fails its episode (:class:`ServerLostError`: the pool runs
it again from scratch), so that no sample is half from a server that died. Under a launcher that
restarts servers (the engine was given the run directory) every such request fails its episode:
no episode keeps samples from before a server's death beside samples from after it. A server the launcher
restarted (:mod:`megarl.rollout.restarts`) stays out of rotation until the trainer has pushed its
weights to it (:meth:`RemoteInferenceEngine.servers_to_readmit`). Batching (``submit``, ``wait``,
``prepare_batch`` ...) is delegated to a :class:`RolloutPool`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

from megarl.api import context as workflow_context
from megarl.api.engine_api import InferenceEngine
from megarl.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse, derive_seed
from megarl.api.rollout_control import RolloutControl
from megarl.api.workflow_api import WorkflowLike
from megarl.config.rollout import InferenceEngineConfig
from megarl.rollout.backend import GenerationChunk, HttpCall, InferenceBackend, check_chunk
from megarl.rollout.http import (
    InferenceServerError,
    RetryPolicy,
    ServerUnavailableError,
    arequest_with_retry,
    make_session,
)
from megarl.rollout.pool import RolloutPool
from megarl.rollout.restarts import JOINS_FILE, RestartLog
from megarl.rollout.server import resolve_server_addrs
from megarl.utils import stats_tracker
from megarl.utils.heartbeat import InFlight
from megarl.workflow.dump import TrajectoryDumper

logger = logging.getLogger(__name__)

_STICKY_CAPACITY = 100_000  # rids remembered for sticky routing (LRU)
_PAUSE_POLL_S = 0.05
_CONTROL_POLICY = RetryPolicy(timeout=120.0, retries=3, backoff=0.5)


class NoHealthyServerError(InferenceServerError):
    """Every server is marked unhealthy."""


class ServerLostError(InferenceServerError):
    """A server became unreachable while a sample was half generated on it: the episode must run again."""

    def __init__(self, address: str, reason: str):
        super().__init__(address, "", reason, kind="server_lost")


@dataclass
class _Server:
    address: str
    in_flight: int = 0
    unhealthy_until: float = 0.0
    why_unhealthy: str = ""
    awaiting_push: bool = False  # restarted by the launcher: the trainer's weights are not on it yet

    def usable(self, now: float) -> bool:
        return now >= self.unhealthy_until


def make_backend(name: str) -> InferenceBackend:
    """The backend called ``name`` (``"vllm"`` or ``"sglang"``)."""
    if name == "vllm":
        from megarl.rollout.vllm import VLLMBackend

        return VLLMBackend()
    if name == "sglang":
        from megarl.rollout.sglang import SGLangBackend

        return SGLangBackend()
    raise ValueError(f"unknown inference backend {name!r}: expected 'vllm' or 'sglang'")


class RemoteInferenceEngine(InferenceEngine, RolloutControl):
    """Generation on remote vLLM / SGLang servers, and the rollout pool on top.

    Args:
        config: The ``rollout`` section of the experiment config.
        backend: A backend instance or its name (``"vllm"``, ``"sglang"``).
    """

    def __init__(self, config: InferenceEngineConfig, backend: InferenceBackend | str = "vllm"):
        config.check()
        self.config = config
        self.backend = make_backend(backend) if isinstance(backend, str) else backend
        self.backend.return_routed_experts = config.return_routed_experts
        self.policy = RetryPolicy(config.request_timeout, config.request_retries, config.retry_backoff)
        self._servers: list[_Server] = []
        self._sticky: collections.OrderedDict[str, _Server] = collections.OrderedDict()
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._version = 0
        self._paused = False
        self._destroyed = False
        self._max_connections = 64
        self._requests = InFlight("request(s) outstanding")  # by server, for the watchdog
        self.pool: RolloutPool | None = None
        self.tokenizer: Any = None
        self._restarts: RestartLog | None = None
        self._joins: RestartLog | None = None
        self._left: set[str] = set()  # servers that left the run: drained, never back in rotation
        self._next_readmit_probe = 0.0
        self.restarts_seen = 0
        """Server restarts the launcher recorded since this engine started."""
        self.servers_joined = 0
        """Servers that joined the run (``megarl serve --join``) since this engine started."""

    # ------------------------------------------------------------------ lifecycle

    def initialize(
        self,
        server_addrs: list[str] | None = None,
        batch_size: int | None = None,
        dump_dir: str | None = None,
        tokenizer: Any = None,
        wait_healthy: bool = True,
        **_: Any,
    ) -> RemoteInferenceEngine:
        """Find the servers, check their health and start the rollout pool.

        Args:
            server_addrs: ``host:port`` list; default: ``config.server_addrs`` or the env variable.
            batch_size: Trajectories per training step (the staleness unit); default
                ``config.max_concurrent_rollouts``.
            dump_dir: The run directory (``{fileroot}/{experiment}/{trial}``): for
                ``config.dump_trajectories``, and where the launcher records server restarts.
            tokenizer: Decodes dumped trajectories; agent workflows given none render their chat with it.
            wait_healthy: Wait (up to ``config.setup_timeout``) until every server answers.
        """
        self.tokenizer = tokenizer
        addrs = list(server_addrs) if server_addrs else resolve_server_addrs(self.config)
        self._servers = [_Server(a) for a in addrs]
        self._restarts = RestartLog(dump_dir) if dump_dir is not None else None
        self._joins = RestartLog(dump_dir, name=JOINS_FILE) if dump_dir is not None else None
        batch_size = batch_size or self.config.max_concurrent_rollouts
        if batch_size is None:
            raise ValueError("RemoteInferenceEngine.initialize: pass batch_size or set rollout.max_concurrent_rollouts")
        concurrency = self.config.max_concurrent_rollouts or batch_size
        self._max_connections = self.config.max_connections or max(64, 16 * concurrency)
        if wait_healthy:
            self._wait_healthy(self.config.setup_timeout)
        dumper = None
        if self.config.dump_trajectories:
            if dump_dir is None:
                raise ValueError("rollout.dump_trajectories is set: initialize() needs dump_dir (the run directory)")
            dumper = TrajectoryDumper(dump_dir, tokenizer)
        self.pool = RolloutPool(self, self.config, batch_size, dumper).start()
        logger.info("inference engine ready: %d %s server(s) %s", len(addrs), self.backend.name, addrs)
        return self

    def destroy(self) -> None:
        """Stop the pool (cancelling running episodes) and close connections."""
        self._destroyed = True
        if self.pool is not None:
            self.pool.destroy()
            self.pool = None

    def start_heartbeat(self, run_dir, name: str, interval: float) -> None:
        """The rollout pool's heartbeat, beaten from its event loop (:meth:`RolloutPool.start_heartbeat`)."""
        self._require_pool().start_heartbeat(run_dir, name, interval)

    def _wait_healthy(self, timeout: float) -> None:
        async def probe_all() -> list[bool]:
            async with make_session(len(self._servers) + 1) as session:
                return await asyncio.gather(*(self._probe(session, s.address) for s in self._servers))

        deadline = time.monotonic() + timeout
        while True:
            healthy = asyncio.run(probe_all())
            if all(healthy):
                return
            if time.monotonic() > deadline:
                down = [s.address for s, ok in zip(self._servers, healthy) if not ok]
                raise InferenceServerError(
                    ",".join(down),
                    self.backend.health_endpoint,
                    f"not healthy within setup_timeout={timeout:g}s",
                    attempts=0,
                )
            time.sleep(1.0)

    async def _probe(self, session: aiohttp.ClientSession, address: str) -> bool:
        url = f"http://{address}{self.backend.health_endpoint}"
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    def _session(self) -> aiohttp.ClientSession:
        """The session of the running event loop (one per loop: sessions are loop-bound)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.get(loop)
            if session is None or session.closed:
                for old in [lp for lp in self._sessions if lp.is_closed()]:
                    del self._sessions[old]
                session = self._sessions[loop] = make_session(self._max_connections)
            return session

    async def aclose(self) -> None:
        """Close the running loop's session (the pool calls this when it stops)."""
        with self._lock:
            session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    # ------------------------------------------------------------------ routing

    def choose_server(self, rid: str | None = None) -> _Server:
        """The sticky server of ``rid`` if usable, else the least-loaded (or next) usable one."""
        self._note_restarts()
        now = time.monotonic()
        with self._lock:
            server = self._sticky.get(rid) if rid is not None else None
            if server is not None and server.usable(now):
                self._sticky.move_to_end(rid)
                return server
            usable = [s for s in self._servers if s.usable(now)]
            if not usable:
                why = "; ".join(f"{s.address}: {s.why_unhealthy}" for s in self._servers)
                raise NoHealthyServerError(
                    ",".join(s.address for s in self._servers), "", f"every inference server is marked unhealthy ({why})",
                    0, kind="no_server",
                )
            if self.config.schedule_policy == "round_robin":
                server = usable[next(self._rr) % len(usable)]
            else:
                server = min(usable, key=lambda s: s.in_flight)
            if rid is not None:
                self._sticky[rid] = server
                if len(self._sticky) > _STICKY_CAPACITY:
                    self._sticky.popitem(last=False)
            return server

    @property
    def server_addresses(self) -> list[str]:
        """Every server's ``host:port``, healthy or not."""
        return [s.address for s in self._servers]

    def server_listing(self) -> tuple[str, list[str]]:
        """The backend's name and every server's address (before :meth:`initialize`: the configured ones)."""
        return self.backend.name, self.server_addresses or resolve_server_addrs(self.config)

    def mark_unhealthy(self, address: str, reason: str) -> None:
        """Take ``address`` out of rotation until :meth:`mark_healthy` (e.g. it failed a weight update)."""
        for server in self._servers:
            if server.address == address:
                with self._lock:
                    logger.warning("taking %s out of rotation: %s", address, reason)
                    server.unhealthy_until = math.inf
                    server.why_unhealthy = reason
                return
        raise ValueError(f"mark_unhealthy: {address} is not one of the servers {self.server_addresses}")

    def mark_healthy(self, address: str) -> None:
        """Put ``address`` back into rotation (its weights are current again), unless it left the run."""
        if address in self._left:
            return
        with self._lock:
            for server in self._servers:
                if server.address == address:
                    server.unhealthy_until = 0.0
                    server.awaiting_push = False

    def _note_restarts(self) -> None:
        """Take the servers the launcher restarted out of rotation until the trainer pushes its weights; add
        the servers that joined the run (out of rotation the same way) and drain those that left."""
        for address in self._restarts.new_addresses() if self._restarts is not None else []:
            for server in self._servers:
                if server.address == address:
                    self.restarts_seen += 1
                    self.mark_unhealthy(address, "restarted by the launcher; back once the trainer has pushed its weights")
                    server.awaiting_push = True
        for record in self._joins.new_records() if self._joins is not None else []:
            if record.get("event") == "leave":
                self._drain(record["address"])
            elif record["address"] not in self.server_addresses:
                self._join(record["address"])

    def _join(self, address: str) -> None:
        """A server started with ``megarl serve --join``: in the pool, out of rotation until the trainer's
        weight sync has pushed the current weights and version to it."""
        with self._lock:
            self._servers.append(_Server(address, unhealthy_until=math.inf, awaiting_push=True,
                                         why_unhealthy="joined the run; in rotation once it holds the current weights"))  # fmt: skip
        self.servers_joined += 1
        logger.info("server %s joined the run; it serves once the next weight sync reaches it", address)

    def _drain(self, address: str) -> None:
        """A joined server leaves: no new request goes to it (requests running there finish); the bridge lets it go."""
        if address in self.server_addresses and address not in self._left:
            self.mark_unhealthy(address, "left the run (megarl serve --join stopped): drained")
            self._left.add(address)

    def servers_to_readmit(self) -> tuple[list[str], list[str]]:
        """Servers awaiting the trainer's weights (restarted or joined): (those answering their health check,
        the others and those that left the run)."""
        self._note_restarts()
        waiting = [s.address for s in self._servers if s.awaiting_push and s.address not in self._left]
        healthy = self.answering(waiting)
        back = [a for a, ok in zip(waiting, healthy) if ok]
        return back, [a for a, ok in zip(waiting, healthy) if not ok] + sorted(self._left)

    def answering(self, addresses: list[str]) -> list[bool]:
        """One health probe of each of ``addresses`` (from a thread without a running event loop)."""

        async def probe_all() -> list[bool]:
            async with make_session(len(addresses) + 1) as session:
                return await asyncio.gather(*(self._probe(session, a) for a in addresses))

        return asyncio.run(probe_all()) if addresses else []

    def readmit_due(self) -> bool:
        """Whether no server can take requests while a restarted one answers again and waits for the
        trainer's weights (probed at most once a second)."""
        self._note_restarts()
        now = time.monotonic()
        with self._lock:
            if any(s.usable(now) for s in self._servers) or not any(s.awaiting_push for s in self._servers):
                return False
            if now < self._next_readmit_probe:
                return False
            self._next_readmit_probe = now + 1.0
        return bool(self.servers_to_readmit()[0])

    def _mark_unhealthy(self, server: _Server, error: Exception) -> None:
        with self._lock:
            if math.isinf(server.unhealthy_until):
                return  # out of rotation until mark_healthy
            if server.usable(time.monotonic()):
                logger.warning(
                    "marking %s unhealthy for %.0fs: %s", server.address, self.config.unhealthy_retry_interval, error
                )
            server.unhealthy_until = time.monotonic() + self.config.unhealthy_retry_interval
            server.why_unhealthy = str(error)

    # ------------------------------------------------------------------ generation

    async def _send(self, server: _Server, payload: dict[str, Any], max_tokens: int) -> GenerationChunk:
        server.in_flight += 1
        try:
            with self._requests.track(server.address, workflow_context.get().task_id):
                return await arequest_with_retry(
                    self._session(),
                    server.address,
                    self.backend.generate_endpoint,
                    payload,
                    policy=self.policy,
                    parse=lambda body: check_chunk(self.backend.parse_generate(body), max_tokens),
                    give_up=lambda: not server.usable(time.monotonic()),
                )
        finally:
            server.in_flight -= 1

    def describe_outstanding(self) -> str:
        """The generation requests waiting for a server now, by server, oldest first (for the watchdog)."""
        return self._requests.describe()

    async def _wait_while_paused(self) -> None:
        while self._paused and not self._destroyed:
            await asyncio.sleep(_PAUSE_POLL_S)

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
                server = self.choose_server(req.rid)
            except NoHealthyServerError:
                if any(s.awaiting_push for s in self._servers) and time.monotonic() < restart_deadline:
                    await asyncio.sleep(_PAUSE_POLL_S * 10)  # a restarted server comes back once the trainer pushed
                    continue
                outages += 1
                if outages > self.policy.retries or not await self._wait_for_a_server():
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
            )
            try:
                chunk = await self._send(server, payload, remaining)
            except ServerUnavailableError as e:
                self._mark_unhealthy(server, e)
                # never half a sample from a server that died: the episode runs again; under a launcher that
                # restarts servers (a restart log), nor half an episode: its finished samples are not kept either
                if resp.output_tokens or self._restarts is not None:
                    raise ServerLostError(server.address, f"unreachable: {e}") from e
                continue  # nothing generated yet: another server
            if not resp.ttft:
                resp.ttft = time.perf_counter() - start
            resp.server = server.address
            self._append(resp, chunk, version, remaining)
            if chunk.finish_reason != "abort" or self._destroyed:
                resp.stop_reason = chunk.finish_reason
                break
            resp.n_interruptions += 1
            stalled = 0 if (chunk.output_tokens or self._paused) else stalled + 1
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

    async def _wait_for_a_server(self) -> bool:
        """Sleep until the first server marked unhealthy for a while is tried again; False when every
        server is out of rotation for good (:meth:`mark_unhealthy`)."""
        with self._lock:
            back = min(s.unhealthy_until for s in self._servers)
        if math.isinf(back):
            return False
        await asyncio.sleep(max(0.0, back - time.monotonic()))
        return True

    @staticmethod
    def _append(resp: ModelResponse, chunk: GenerationChunk, version: int, remaining: int) -> None:
        if len(chunk.output_tokens) > remaining:
            raise InferenceServerError(
                resp.server, "", f"{len(chunk.output_tokens)} tokens for a budget of {remaining}", kind="malformed"
            )
        resp.output_tokens += chunk.output_tokens
        resp.output_logprobs += chunk.output_logprobs
        if chunk.routed_experts is not None:
            resp.output_routed_experts = (resp.output_routed_experts or []) + chunk.routed_experts
        resp.output_versions += [version] * len(chunk.output_tokens)

    # ------------------------------------------------------------------ pause / resume / version

    def _run_sync(self, coro) -> Any:
        """Run a control coroutine from a plain thread (on the pool's loop when it runs)."""
        loop = self.pool.loop if self.pool is not None else None
        if loop is not None and loop.is_running():
            return asyncio.run_coroutine_threadsafe(coro, loop).result()
        return asyncio.run(coro)

    async def _control(self, calls: list[HttpCall]) -> None:
        """Send ``calls`` in order to every server (concurrently across servers)."""

        async def run_on(session: aiohttp.ClientSession, server: _Server) -> None:
            for call in calls:
                await arequest_with_retry(
                    session,
                    server.address,
                    call.endpoint,
                    call.payload,
                    method=call.method,
                    params=call.params or None,
                    policy=_CONTROL_POLICY,
                    expect_json=False,
                )

        async with make_session(2 * len(self._servers) + 1) as session:
            results = await asyncio.gather(*(run_on(session, s) for s in self._servers), return_exceptions=True)
        for server, result in zip(self._servers, results):
            if isinstance(result, ServerUnavailableError):
                self._mark_unhealthy(server, result)  # a dead server is skipped, not fatal
            elif isinstance(result, BaseException):
                raise result

    def pool_idle(self) -> bool:
        """Whether no episode of the rollout pool is running (the servers have no work from it)."""
        return self.pool is None or self.pool.idle

    def pause(self) -> None:
        """Stop new episodes and abort in-flight generations on every server (they continue after resume)."""
        if self.pool is not None:
            self.pool.pause()
        self._paused = True
        self._run_sync(self._control(self.backend.pause_calls()))

    def resume(self, start_episodes: bool = True) -> None:
        """Let the servers generate again, continue interrupted generations, start episodes
        (unless ``start_episodes`` is False: then :meth:`start_episodes` does, later)."""
        self._run_sync(self._control(self.backend.resume_calls()))
        self._paused = False
        if start_episodes:
            self.start_episodes()

    def sleep(self) -> None:
        """Colocated placement: stop new episodes, abort in-flight generations (they continue after
        :meth:`resume`) and free the servers' device memory for the trainer."""
        if self.pool is not None:
            self.pool.pause()
        self._paused = True
        self._run_sync(self._control(self.backend.sleep_calls()))

    def wake(self) -> None:
        """Bring sleeping servers' memory back; they stay paused until :meth:`resume` (after new weights)."""
        self._run_sync(self._control(self.backend.wake_calls()))

    def start_episodes(self) -> None:
        """Let the rollout pool start new episodes again (after ``pause``)."""
        if self.pool is not None:
            self.pool.resume()

    def set_version(self, version: int) -> None:
        self._version = int(version)
        if self.pool is not None:
            self.pool.notify_version()

    def get_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ batching (the pool)

    def _require_pool(self) -> RolloutPool:
        if self.pool is None:
            raise RuntimeError("RemoteInferenceEngine is not initialized: call initialize() first")
        return self.pool

    def submit(
        self,
        data: dict[str, Any],
        workflow: WorkflowLike,
        should_accept_fn: Callable | str | None = None,
        group_size: int = 1,
        workflow_kwargs: dict[str, Any] | None = None,
        is_eval: bool = False,
    ) -> int:
        """Queue one episode (see :meth:`RolloutPool.submit`); returns its task id.

        The argument names are AReaL's; pass all but ``data`` and ``workflow`` by keyword
        (AReaL's positional order differs after ``workflow``).
        """
        return self._require_pool().submit(data, workflow, should_accept_fn, group_size, workflow_kwargs, is_eval)

    def wait(self, count: int, timeout: float | None = None, raise_timeout: bool = True) -> list[dict[str, Any]]:
        """``count`` accepted trajectories, oldest first (see :meth:`RolloutPool.wait`).

        ``raise_timeout=False`` (AReaL's option) returns ``[]`` after ``timeout`` instead of
        raising ``TimeoutError``.
        """
        try:
            return self._require_pool().wait(count, timeout)
        except TimeoutError:
            if raise_timeout:
                raise
            return []

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: WorkflowLike,
        should_accept_fn: Callable | str | None = None,
        group_size: int = 1,
        workflow_kwargs: dict[str, Any] | None = None,
        is_eval: bool = False,
    ) -> dict[str, Any]:
        """One episode per item, synchronously, outside the staleness budget (see
        :meth:`RolloutPool.rollout_batch`); ``is_eval=True`` for evaluation episodes."""
        return self._require_pool().rollout_batch(
            data, workflow, should_accept_fn, group_size, workflow_kwargs, is_eval
        )

    def prepare_batch(
        self,
        dataloader: Iterable,
        workflow: WorkflowLike,
        should_accept_fn: Callable | str | None = None,
        group_size: int = 1,
        workflow_kwargs: dict[str, Any] | None = None,
        progress: Callable[[int], None] | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> dict[str, Any] | None:
        """``dataloader.batch_size`` accepted trajectories, or None once ``interrupt()`` (see
        :meth:`RolloutPool.prepare_batch`)."""
        return self._require_pool().prepare_batch(
            dataloader, workflow, should_accept_fn, group_size, workflow_kwargs, progress, interrupt
        )


def _continuation(gconfig: GenerationHyperparameters, generated: list[int]) -> GenerationHyperparameters:
    """A continued sample (after a pause) draws fresh seeded randomness, still reproducibly."""
    if gconfig.seed is None or not generated:
        return gconfig
    return gconfig.new(seed=derive_seed(gconfig.seed, generated, len(generated)))
