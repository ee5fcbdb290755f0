"""The remote inference engine: the ``InferenceEngine`` API over HTTP inference servers.

Three parts, each owned here and none holding another:

* :class:`~megarl.serving.servers.ServerSet`: the servers and their lifecycle (routing, health,
  restart, join, leave, readmission, control calls);
* :class:`~megarl.rollout.client.GenerationClient`: ``agenerate``, interruptible across weight
  updates, every token stamped with its version; the pool hands it to workflows as their engine;
* :class:`~megarl.rollout.pool.RolloutPool`: episodes on an asyncio loop and the batches the trainer
  takes (``submit``, ``wait``, ``rollout_batch``, ``prepare_batch``).

The engine implements :class:`~megarl.api.rollout_control.RolloutControl`, what the trainer's weight
sync drives around an update: pause, resume, sleep, wake, versions and the servers' readmission.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

from megarl.api.engine_api import InferenceEngine
from megarl.api.io_struct import ModelRequest, ModelResponse
from megarl.api.workflow_api import WorkflowLike
from megarl.config.rollout import InferenceEngineConfig
from megarl.rollout.client import GenerationClient
from megarl.rollout.pool import RolloutPool
from megarl.rollout.teacher import TeacherScorer
from megarl.serving import make_backend
from megarl.serving.backend import HttpCall, InferenceBackend
from megarl.serving.launch import resolve_server_addrs
from megarl.serving.servers import ServerSet
from megarl.workflow.dump import TrajectoryDumper

logger = logging.getLogger(__name__)


class RemoteInferenceEngine(InferenceEngine):
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
        self._servers: ServerSet | None = None  # initialize() finds them
        self._client: GenerationClient | None = None  # initialize() builds it on the servers
        self._version = 0  # the policy version set before initialize()
        self._dumper: TrajectoryDumper | None = None  # rollout.dump_trajectories
        self.pool: RolloutPool | None = None

    @property
    def servers(self) -> ServerSet:
        """The servers and their lifecycle (:class:`~megarl.serving.servers.ServerSet`), from :meth:`initialize`."""
        if self._servers is None:
            raise RuntimeError("RemoteInferenceEngine is not initialized: call initialize() first")
        return self._servers

    @property
    def client(self) -> GenerationClient:
        """The generation client on :attr:`servers`, from :meth:`initialize`."""
        if self._client is None:
            raise RuntimeError("RemoteInferenceEngine is not initialized: call initialize() first")
        return self._client

    # ------------------------------------------------------------------ lifecycle

    def initialize(
        self,
        server_addrs: list[str] | None = None,
        batch_size: int | None = None,
        dump_dir: str | None = None,
        tokenizer: Any = None,
        wait_healthy: bool = True,
        vocab_size: int | None = None,
        head: tuple[int, int] = (0, 1),
        teacher: TeacherScorer | None = None,
        **_: Any,
    ) -> RemoteInferenceEngine:
        """Find the servers, check their health and start the rollout pool.

        Args:
            server_addrs: ``host:port`` list; default: ``config.server_addrs`` or the env variable.
            batch_size: Trajectories per training step (the staleness unit): ``prepare_batch``'s
                dataloader ``batch_size``; default ``config.max_concurrent_rollouts``.
            dump_dir: The run directory (``{fileroot}/{experiment}/{trial}``): for
                ``config.dump_trajectories``, and where the launcher records server restarts.
            tokenizer: Decodes dumped trajectories; agent workflows given none render their chat with it.
            wait_healthy: Wait (up to ``config.setup_timeout``) until every server answers.
            vocab_size: The trainer's vocabulary size: a reply holding a token id at or beyond it is
                refused like any reply that cannot be trained on (None: not checked).
            head: ``(index, count)`` of the data-parallel heads that each run an engine for the same run:
                this engine's task ids are ``index, index + count, ...``, so that no two heads share one
                (in the logs, and in the file names of dumped trajectories).
            teacher: On-policy distillation: scores every accepted training trajectory (``teacher_logp``).
        """
        index, count = head
        if not 0 <= index < count:
            raise ValueError(
                f"RemoteInferenceEngine.initialize: head={head} is not (index, count) with 0 <= index < count"
            )
        addrs = list(server_addrs) if server_addrs else resolve_server_addrs(self.config)
        self.backend.vocab_size = vocab_size
        batch_size = batch_size or self.config.max_concurrent_rollouts
        if batch_size is None:
            raise ValueError("RemoteInferenceEngine.initialize: pass batch_size or set rollout.max_concurrent_rollouts")
        dumper = None
        if self.config.dump_trajectories:
            if dump_dir is None:
                raise ValueError("rollout.dump_trajectories is set: initialize() needs dump_dir (the run directory)")
            dumper = TrajectoryDumper(dump_dir, tokenizer)
        self._servers = ServerSet(self.config, self.backend, addrs, run_dir=dump_dir)
        if wait_healthy:
            self._servers.wait_healthy(self.config.setup_timeout)
        concurrency = self.config.max_concurrent_rollouts or batch_size
        connections = self.config.max_connections or max(64, 16 * concurrency)
        self._client = GenerationClient(self.config, self.backend, self._servers, connections, tokenizer)
        self._client.set_version(self._version)
        if self.config.switch_interval_ms > 0:  # the pool's loop thread shares the lock with the trainer's Python
            sys.setswitchinterval(self.config.switch_interval_ms / 1000)
        self._dumper = dumper
        self.pool = RolloutPool(self.client, self.config, batch_size, dumper, itertools.count(*head), teacher).start()
        logger.info("inference engine ready: %d %s server(s) %s", len(addrs), self.backend.name, addrs)
        return self

    def destroy(self) -> None:
        """Stop the pool (cancelling running episodes) and close connections."""
        if self._client is not None:
            self._client.stopped = True
        if self.pool is not None:
            self.pool.destroy()
            self.pool = None

    def start_heartbeat(self, run_dir, name: str, interval: float) -> None:
        """The rollout pool's heartbeat, beaten from its event loop (:meth:`RolloutPool.start_heartbeat`)."""
        self._require_pool().start_heartbeat(run_dir, name, interval)

    def _require_pool(self) -> RolloutPool:
        if self.pool is None:
            raise RuntimeError("RemoteInferenceEngine is not initialized: call initialize() first")
        return self.pool

    # ------------------------------------------------------------------ generation and the watchdog

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one sample (see :meth:`GenerationClient.agenerate`)."""
        return await self.client.agenerate(req)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer given to :meth:`initialize` (None before)."""
        return None if self._client is None else self._client.tokenizer

    def describe_outstanding(self) -> str:
        """The generation requests waiting for a server now, by server, oldest first (for the watchdog)."""
        return self.client.describe_outstanding()

    def pool_idle(self) -> bool:
        """Whether no episode of the rollout pool is running (the servers have no work from it)."""
        return self.pool is None or self.pool.idle

    # ------------------------------------------------------------------ the servers (RolloutControl)

    @property
    def server_addresses(self) -> list[str]:
        """Every server's ``host:port``, healthy or not."""
        return self.servers.addresses

    def readmit_due(self) -> bool:
        """Whether no server can take requests while a restarted one answers again and waits for the weights."""
        return self.servers.readmit_due()

    @property
    def restarts_seen(self) -> int:
        """Server restarts the launcher recorded since this engine started."""
        return self.servers.restarts_seen

    @property
    def servers_joined(self) -> int:
        """Servers that joined the run (``megarl serve --join``) since this engine started."""
        return self.servers.servers_joined

    # ------------------------------------------------------------------ pause / resume / version

    def _control(self, calls: list[HttpCall]) -> None:
        """Send ``calls`` to every server, on the trainer's control loop (not the pool's)."""
        self.servers.control_all(calls)

    def pause(self, servers: bool = True) -> None:
        """Stop new episodes and hold generations; with ``servers`` also abort in-flight generations on
        every server (they continue after resume)."""
        self._stop_episodes()
        if servers:
            self._control(self.backend.pause_calls())

    def resume(self, start_episodes: bool = True, servers: bool = True) -> None:
        """Let the servers generate again (``servers``: resume each), continue interrupted generations,
        start episodes (unless ``start_episodes`` is False: then :meth:`start_episodes` does, later)."""
        if servers:
            self._control(self.backend.resume_calls())
        self.client.paused = False
        if start_episodes:
            self.start_episodes()

    def sleep(self) -> None:
        """Colocated placement: stop new episodes, abort in-flight generations (they continue after
        :meth:`resume`) and free the servers' device memory for the trainer."""
        self._stop_episodes()
        self._control(self.backend.sleep_calls())

    def wake(self) -> None:
        """Bring sleeping servers' memory back; they stay paused until :meth:`resume` (after new weights)."""
        self._control(self.backend.wake_calls())

    def _stop_episodes(self) -> None:
        if self.pool is not None:
            self.pool.pause()
        if self._client is not None:
            self._client.paused = True

    def start_episodes(self) -> None:
        """Let the rollout pool start new episodes again (after ``pause``)."""
        if self.pool is not None:
            self.pool.resume()

    def set_version(self, version: int) -> None:
        self._version = version
        if self._client is not None:
            self._client.set_version(version)
        if self.pool is not None:
            self.pool.notify_version()

    def use_adapter(self, name: str | None) -> None:
        self.servers.adapter = name

    def set_aside_earlier_dumps(self) -> None:
        """With ``rollout.dump_trajectories``: the trajectories an earlier start of the run dumped at the current
        version or later (the steps this start trains again) are moved aside
        (:meth:`~megarl.workflow.dump.TrajectoryDumper.set_aside_from`). The trainer calls it once it has set
        the version it starts at, before any episode."""
        if self._dumper is not None:
            self._dumper.set_aside_from(self.get_version())

    def get_version(self) -> int:
        return self._version if self._client is None else self._client.get_version()

    # ------------------------------------------------------------------ batching (the pool)

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

    def pending_items(self) -> list[dict[str, Any]]:
        """Dataloader items whose trajectories the trainer has not received yet (see
        :meth:`RolloutPool.pending_items`); ``[]`` before :meth:`initialize`."""
        return self.pool.pending_items() if self.pool is not None else []

    def resubmit(
        self, version: int, items: list[dict[str, Any]], workflow: WorkflowLike, should_accept_fn=None
    ) -> None:
        """Resume a recovered run at ``version`` with its pending ``items`` first (see :meth:`RolloutPool.resubmit`)."""
        self._require_pool().resubmit(version, items, workflow, should_accept_fn)


class RemoteSGLangEngine(RemoteInferenceEngine):
    """AReaL's name: the remote engine on SGLang servers (``RemoteInferenceEngine(config, "sglang")``)."""

    def __init__(self, config: InferenceEngineConfig):
        super().__init__(config, "sglang")


class RemoteVLLMEngine(RemoteInferenceEngine):
    """AReaL's name: the remote engine on vLLM servers (``RemoteInferenceEngine(config, "vllm")``)."""

    def __init__(self, config: InferenceEngineConfig):
        super().__init__(config, "vllm")
