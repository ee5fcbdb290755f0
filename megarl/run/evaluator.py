"""Periodic evaluation (AReaL's ``Evaluator``): greedy pass@1, or pass@k of sampled sequences, through the rollout pool."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from megarl.api.io_struct import GenerationHyperparameters
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


def evaluation_gconfig(config: EvaluatorConfig, gconfig: GenerationHyperparameters) -> GenerationHyperparameters:
    """The evaluation's sampling: the run's ``gconfig`` with ``config.n_samples``, greedy unless it samples."""
    if config.greedy:
        return gconfig.new(n_samples=1, greedy=True)
    return gconfig.new(n_samples=config.n_samples, greedy=False, temperature=config.temperature or gconfig.temperature)


def pass_at_1(rollout, items: list[dict[str, Any]], workflow, max_samples: int | None = None) -> dict[str, float]:
    """Greedy pass@1 of ``workflow`` on ``items`` (the first ``max_samples`` of them when given).

    Runs one evaluation episode per item through ``rollout.rollout_batch(...,
    is_eval=True)`` (outside the staleness budget). The workflow should decode greedily
    (``gconfig.new(greedy=True, n_samples=1)``). Rejected episodes do not count.

    Returns ``eval/pass@1`` (fraction of sequences with reward > 0.5), ``eval/n_samples``
    (sequences scored) and ``eval/reward`` (their mean reward); 0 when none came back.
    """
    _warn_if_sampling(workflow)
    return pass_at_k(rollout, items, workflow, 1, max_samples)


def pass_at_k(
    rollout, items: list[dict[str, Any]], workflow, n_samples: int, max_samples: int | None = None
) -> dict[str, float]:
    """pass@k of ``workflow`` sampling ``n_samples`` sequences per item (``gconfig.n_samples``, as the
    built-in workflows do), on the first ``max_samples`` of ``items`` when given.

    Returns what :func:`pass_at_1` does, ``eval/pass@1`` being the mean over all sequences, and
    ``eval/pass@k`` for k = 2, 4, ... and ``n_samples``: the share of items solved by at least one of k
    sequences drawn from their ``n_samples``, by the unbiased estimator (Chen et al., 2021,
    ``1 - C(n - c, k) / C(n, k)`` for ``c`` solved of ``n``). Without ``n_samples`` sequences of each
    item returned (a workflow that returns another count), only pass@1 is given, with a warning.
    """
    items = items[:max_samples] if max_samples is not None else items
    traj = rollout.rollout_batch(items, workflow, is_eval=True)
    rewards = traj.get("rewards")
    n = 0 if rewards is None else rewards.numel()
    if n == 0:
        logger.warning("evaluation returned no sequences for %d items (all rejected?)", len(items))
        return {"eval/pass@1": 0.0, "eval/n_samples": 0.0, "eval/reward": 0.0}
    rewards = rewards.double().flatten()
    solved = rewards > _CORRECT
    stats = {
        "eval/pass@1": solved.double().mean().item(),
        "eval/n_samples": float(n),
        "eval/reward": rewards.mean().item(),
    }
    if n_samples == 1:
        return stats
    if n % n_samples:
        logger.warning("evaluation: %d sequences came back, not %d per item: pass@k is not computed", n, n_samples)
        return stats
    counts = solved.view(-1, n_samples).sum(1).tolist()
    for k in _ks(n_samples):
        stats[f"eval/pass@{k}"] = sum(_pass_at(n_samples, c, k) for c in counts) / len(counts)
    return stats


def _ks(n: int) -> list[int]:
    """2, 4, 8, ... below ``n``, then ``n``."""
    return [2**i for i in range(1, n.bit_length()) if 2**i < n] + [n]


def _pass_at(n: int, c: int, k: int) -> float:
    """The chance that k of n sequences, c of them solved, drawn without replacement hold a solved one."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _warn_if_sampling(workflow) -> None:
    gconfig = getattr(workflow, "gconfig", None)
    if gconfig is not None and not getattr(gconfig, "greedy", True):
        logger.warning("pass_at_1 with a sampling workflow (gconfig.greedy=False): the score is not greedy pass@1")
