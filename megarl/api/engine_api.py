"""The inference-engine contract seen by workflows and the training loop."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import Any

from megarl.api.io_struct import ModelRequest, ModelResponse
from megarl.api.rollout_control import RolloutControl
from megarl.api.workflow_api import WorkflowLike


class GenerationEngine(abc.ABC):
    """What a workflow's episode generates with: the ``engine`` of ``arun_episode(engine, data)``."""

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one sample for ``req`` (continuing across weight updates)."""

    @abc.abstractmethod
    def get_version(self) -> int:
        """The current weight version."""


class InferenceEngine(GenerationEngine, RolloutControl):
    """Streams generations for workflows and batches of trajectories for the trainer.

    ``agenerate`` is what a :class:`~megarl.api.workflow_api.RolloutWorkflow` calls;
    ``submit / wait / rollout_batch / prepare_batch`` are what the training loop calls;
    ``pause / set_version / resume`` bracket a weight update (declared once, by
    :class:`~megarl.api.rollout_control.RolloutControl`, the side the weight sync drives).

    ``group_size`` in these calls is AReaL's: how many times the workflow runs on each item (its
    runs are concatenated into one trajectory group, :class:`~megarl.workflow.grouped.GroupedRolloutWorkflow`).
    The rows per group the trainer splits batches by are the trainer's ``granularity``
    (:class:`~megarl.rollout.coordinator.DistRolloutCoordinator`).
    """

    @abc.abstractmethod
    def initialize(self, **kwargs: Any) -> None:
        """Connect to the servers and start the rollout machinery."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Stop the rollout machinery and release connections."""

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one sample for ``req`` (continuing across weight updates)."""

    @abc.abstractmethod
    def submit(
        self,
        data: dict[str, Any],
        workflow: WorkflowLike,
        should_accept_fn: Callable[[dict[str, Any]], bool] | None = None,
        group_size: int = 1,
        workflow_kwargs: dict[str, Any] | None = None,
        is_eval: bool = False,
    ) -> int:
        """Queue one episode of ``workflow`` on ``data`` (blocks while the input queue is full); its task id.
        ``group_size``: runs of the workflow on ``data`` in the episode."""

    @abc.abstractmethod
    def wait(self, count: int, timeout: float | None = None, raise_timeout: bool = True) -> list[dict[str, Any]]:
        """Return ``count`` accepted trajectories, oldest first; after ``timeout`` s ``TimeoutError``
        (or ``[]`` with ``raise_timeout=False``)."""

    @abc.abstractmethod
    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: WorkflowLike,
        should_accept_fn: Callable[[dict[str, Any]], bool] | None = None,
        group_size: int = 1,
        workflow_kwargs: dict[str, Any] | None = None,
        is_eval: bool = False,
    ) -> dict[str, Any]:
        """Run one episode per item of ``data`` and return the accepted ones, concatenated and padded
        (outside the staleness budget; ``is_eval`` for evaluation episodes)."""

    @abc.abstractmethod
    def prepare_batch(
        self,
        dataloader: Iterable[list[dict[str, Any]]],
        workflow: WorkflowLike,
        should_accept_fn: Callable[[dict[str, Any]], bool] | None = None,
        group_size: int = 1,
        workflow_kwargs: dict[str, Any] | None = None,
        progress: Callable[[int], None] | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> dict[str, Any] | None:
        """Keep episodes flowing from ``dataloader``; return ``dataloader.batch_size`` accepted ones,
        concatenated and padded.

        ``group_size``: runs of the workflow per item. ``progress(n)``: called while it waits, with the
        number of accepted episodes gathered so far (the trainer's rollout status). ``interrupt()``:
        polled while it waits; once it returns true, the call returns None and keeps what it gathered
        for the next call (the trainer then pushes its weights to restarted servers and calls again).
        """
