"""Periodic evaluation (AReaL's ``Evaluator``) and greedy pass@1 through the rollout pool."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from megarl.config.run import EvaluatorConfig
from megarl.run.saver import FrequencyControl, check_epoch_frequency, due

logger = logging.getLogger(__name__)

_CORRECT = 0.5  # a sequence with a reward above this counts as solved


class Evaluator:
    """Runs an evaluation function when a frequency is reached.

    Args:
        config: Frequencies (and ``max_samples``, which the caller applies to its items).
        steps_per_epoch: Trainer steps per epoch; required for ``config.freq_epochs``.
    """

    def __init__(self, config: EvaluatorConfig, steps_per_epoch: int | None = None):
        check_epoch_frequency(config.freq_epochs, steps_per_epoch, "evaluator")
        self.config = config
        self.steps_per_epoch = steps_per_epoch
        self.freq = FrequencyControl(config.freq_epochs, config.freq_steps, config.freq_secs)

    def maybe_evaluate(
        self, fn: Callable[[], dict[str, float]], epoch: int, epoch_step: int, global_step: int, force: bool = False
    ) -> dict[str, float] | None:
        """``fn()`` when due (or ``force``), else None. With ``freq_secs`` set every rank must call (rank 0 decides)."""
        with self.evaluating(fn, epoch, epoch_step, global_step, force) as stats:
            pass
        return stats()

    @contextlib.contextmanager
    def evaluating(
        self, fn: Callable[[], dict[str, float]], epoch: int, epoch_step: int, global_step: int, force: bool = False
    ) -> Iterator[Callable[[], dict[str, float] | None]]:
        """:meth:`maybe_evaluate` with ``fn`` in a thread while the ``with`` block runs (e.g. a checkpoint
        save: the servers evaluate while the trainer writes); yields a getter of its result for after the block.

        Whether it is due is decided before the thread starts, on this thread: the block may use
        collectives, and ``fn`` must not.
        """
        if not due(self.freq, epoch_step, self.steps_per_epoch, force):
            yield lambda: None
            return
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-evaluator") as pool:
            future = pool.submit(fn)
            yield lambda: self._logged(future.result(), epoch, epoch_step, global_step)

    @staticmethod
    def _logged(stats: dict[str, float], epoch: int, epoch_step: int, global_step: int) -> dict[str, float]:
        if stats:
            logger.info("evaluation at epoch %d step %d (global step %d): %s", epoch, epoch_step, global_step, stats)
        return stats

    def state_dict(self) -> dict:
        """The frequency counters (for recovery)."""
        return {"freq": self.freq.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.freq.load_state_dict(state["freq"])


def pass_at_1(rollout, items: list[dict[str, Any]], workflow, max_samples: int | None = None) -> dict[str, float]:
    """Greedy pass@1 of ``workflow`` on ``items`` (the first ``max_samples`` of them when given).

    Runs one evaluation episode per item through ``rollout.rollout_batch(...,
    is_eval=True)`` (outside the staleness budget). The workflow should decode greedily
    (``gconfig.new(greedy=True, n_samples=1)``). Rejected episodes do not count.

    Returns ``eval/pass@1`` (fraction of sequences with reward > 0.5), ``eval/n_samples``
    (sequences scored) and ``eval/reward`` (their mean reward); 0 when none came back.
    """
    _warn_if_sampling(workflow)
    items = items[:max_samples] if max_samples is not None else items
    traj = rollout.rollout_batch(items, workflow, is_eval=True)
    rewards = traj.get("rewards")
    n = 0 if rewards is None else rewards.numel()
    if n == 0:
        logger.warning("evaluation returned no sequences for %d items (all rejected?)", len(items))
        return {"eval/pass@1": 0.0, "eval/n_samples": 0.0, "eval/reward": 0.0}
    rewards = rewards.float()
    return {
        "eval/pass@1": (rewards > _CORRECT).float().mean().item(),
        "eval/n_samples": float(n),
        "eval/reward": rewards.mean().item(),
    }


def _warn_if_sampling(workflow) -> None:
    gconfig = getattr(workflow, "gconfig", None)
    if gconfig is not None and not getattr(gconfig, "greedy", True):
        logger.warning("pass_at_1 with a sampling workflow (gconfig.greedy=False): the score is not greedy pass@1")
