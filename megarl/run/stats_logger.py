"""Where each step's stats go (AReaL's ``StatsLogger``): console, W&B, TensorBoard, JSONL, curves.

Rank 0 only; on other ranks every method does nothing. Files in ``run_dir``:

* ``metrics.jsonl``: one line per step, ``{"epoch", "epoch_step", "global_step", **stats}``;
* ``curves.png``: one subplot per ``config.plot_keys`` entry with data, against the steps trained
  (1 for the first step, as the console and the report count; 0: the evaluation before training);
* ``tensorboard/`` (when enabled), ``wandb/`` and ``wandb_run_id`` (when W&B is on).

A run recovered at ``start_step`` drops the lines of steps >= ``start_step`` (they are
about to be redone), resumes the same W&B run and purges TensorBoard events from there,
so every output covers the whole run once.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import uuid
from collections import defaultdict
from pathlib import Path

from megarl.config.run import StatsLoggerConfig
from megarl.run.report import build_report, read_metrics_file

logger = logging.getLogger(__name__)

_POSITION = ("epoch", "epoch_step", "global_step")


class StatsLogger:
    """Sends exported ``stats_tracker`` values to the configured outputs at each step.

    Args:
        config: Console, W&B, TensorBoard and plotted keys.
        run_dir: The run's output directory.
        exp_config: The experiment config as a dict (stored with the W&B run).
        rank: Global rank; only rank 0 logs.
        start_step: First global step this process will log (> 0 after a recovery).
    """

    def __init__(
        self,
        config: StatsLoggerConfig,
        run_dir: Path,
        exp_config: dict | None = None,
        rank: int = 0,
        start_step: int = 0,
    ):
        self.config = config
        self.run_dir = Path(run_dir)
        self.active = rank == 0
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        """Per plotted key: (global step, value) of each step that logged it."""
        self.before_training_stats: dict[str, float] = {}
        """Every value of the evaluation before training (this start's, or a resumed run's from its file)."""
        self._wandb = self._tb = None
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._reload_metrics(start_step)
        self._reload_baseline(start_step)
        if config.wandb.mode != "disabled":
            self._wandb = self._init_wandb(exp_config, resume=start_step > 0)
        if config.tensorboard.enabled:
            from torch.utils.tensorboard import SummaryWriter

            # purged from start_step on, 0 included: a trainer restarted fresh drops the failed attempt's steps
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step)

    @property
    def metrics_path(self) -> Path:
        """``{run_dir}/metrics.jsonl``."""
        return self.run_dir / "metrics.jsonl"

    @property
    def curves_path(self) -> Path:
        """``{run_dir}/curves.png``."""
        return self.run_dir / "curves.png"

    def _reload_metrics(self, start_step: int) -> None:
        """Keep the lines of steps before ``start_step`` (and their plotted values); drop the rest."""
        if not self.metrics_path.exists():
            return
        rows = read_metrics_file(self.metrics_path)
        kept = [row for row in rows if row["global_step"] < start_step]
        tmp = self.metrics_path.with_name("metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, self.metrics_path)
        for row in kept:
            self._remember(row["global_step"], row)
        if len(kept) < len(rows):
            logger.info("dropped %d lines of steps >= %d from %s", len(rows) - len(kept), start_step, self.metrics_path)

    def _init_wandb(self, exp_config: dict | None, resume: bool):
        import wandb

        id_file = self.run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        cfg = self.config.wandb
        run = wandb.init(
            mode=cfg.mode,
            project=cfg.project,
            entity=cfg.entity,
            tags=cfg.tags,
            dir=str(self.run_dir),
            id=run_id,
            resume="allow",
            config=exp_config,
            name=self.run_dir.name,
        )
        # steps may repeat after a recovery: plot against a logged field, not W&B's monotonic step
        run.define_metric("global_step")
        run.define_metric("*", step_metric="global_step")
        return run

    def _remember(self, global_step: int, stats: dict) -> None:
        for key in self.config.plot_keys:
            if key in stats:
                self.history[key].append((global_step, float(stats[key])))

    @property
    def baseline_path(self) -> Path:
        """``{run_dir}/before_training.json``: the evaluation before the first step, kept for a resumed run."""
        return self.run_dir / "before_training.json"

    def before_training(self, stats: dict[str, float]) -> None:
        """Values measured before the first step (``eval/pass@1`` of the evaluation before training): the
        curves start from them, at step 0; written to :attr:`baseline_path`, so a resumed run keeps them."""
        if self.active:
            stats = {key: float(value) for key, value in stats.items()}
            tmp = self.baseline_path.with_name(self.baseline_path.name + ".tmp")
            tmp.write_text(json.dumps(stats))
            os.replace(tmp, self.baseline_path)
            self.before_training_stats = stats
            self._draw()

    @property
    def baseline(self) -> dict[str, float]:
        """Plotted values measured before the first step (the evaluation before training)."""
        return {key: value for key, value in self.before_training_stats.items() if key in self.config.plot_keys}

    def _reload_baseline(self, start_step: int) -> None:
        """A resumed run's evaluation before training, from :attr:`baseline_path` (a fresh start measures anew)."""
        if start_step > 0 and self.baseline_path.is_file():
            try:
                self.before_training_stats = json.loads(self.baseline_path.read_text())
            except (OSError, ValueError) as err:
                logger.warning("cannot read %s (%s): the curves start without it", self.baseline_path, err)

    def commit(self, epoch: int, epoch_step: int, global_step: int, stats: dict[str, float]) -> None:
        """Log one step's ``stats`` to every configured output."""
        if not self.active:
            return
        stats = {key: float(value) for key, value in stats.items()}
        position = dict(zip(_POSITION, (epoch, epoch_step, global_step)))
        if self.config.console:
            logger.info("epoch %d step %d (global step %d)\n%s", epoch, epoch_step, global_step, format_table(stats))
        if self._wandb is not None:
            self._wandb.log({**stats, "global_step": global_step})
        if self._tb is not None:
            for key, value in stats.items():
                self._tb.add_scalar(key, value, global_step)
            self._tb.flush()
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({**position, **stats}) + "\n")
        self._remember(global_step, stats)
        self._draw()
        if self.config.report_every and (global_step + 1) % self.config.report_every == 0:
            self.write_report()

    def write_report(self) -> None:
        """(Re)write ``report.html`` (see :mod:`megarl.run.report`); a failure is a warning, not the run's end."""
        if not self.active or not self.metrics_path.exists():
            return
        try:
            build_report(self.run_dir)
        except Exception as e:  # noqa: BLE001 -- a view of the run must not end it
            logger.warning("could not write %s: %r", self.run_dir / "report.html", e)

    def curve(self, key: str) -> list[tuple[int, float]]:
        """(step, value) points of ``key``'s curve: its value before training at step 0, then each step's at
        the number of steps trained (1 for the first step)."""
        points = [(0, self.baseline[key])] if key in self.baseline else []
        return points + [(global_step + 1, value) for global_step, value in self.history.get(key, [])]

    def _draw(self) -> None:
        """Redraw ``curves.png`` (written to a temporary name, then renamed)."""
        keys = [key for key in self.config.plot_keys if self.history.get(key) or key in self.baseline]
        if not keys:
            return
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 2.4 * len(keys)), layout="constrained")
        FigureCanvasAgg(fig)
        for ax, key in zip(fig.subplots(len(keys), 1, squeeze=False)[:, 0], keys):
            steps, values = zip(*self.curve(key))
            ax.plot(steps, values, marker="." if len(steps) < 50 else None)
            ax.set_title(key, fontsize=10)
            ax.set_xlim(left=0)
            ax.grid(alpha=0.3)
        ax.set_xlabel("step (0: before training)")
        tmp = self.curves_path.with_name("curves.tmp.png")
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, self.curves_path)

    def summary(self, window: int = 5) -> dict[str, dict[str, float]]:
        """Per plotted key with data: mean of the first and of the last ``window`` values, last value, steps."""
        out = {}
        for key in self.config.plot_keys:
            values = [value for _, value in self.history.get(key, [])]
            if values:
                out[key] = {
                    "first_mean": _mean(values[:window]),
                    "last_mean": _mean(values[-window:]),
                    "last": values[-1],
                    "n_steps": len(values),
                }
        return out

    def close(self) -> None:
        """Write the run's report, finish the W&B run and close the TensorBoard writer."""
        self.write_report()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def format_table(stats: dict[str, float]) -> str:
    """A compact rich table of ``stats``, one block per key prefix (``rollout/...``, ``ppo_actor/...``)."""
    from rich.console import Console
    from rich.table import Table

    groups: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for key in sorted(stats, key=lambda k: ("/" in k, k)):  # unprefixed keys first
        prefix, _, rest = key.partition("/")
        groups[prefix if rest else ""].append((rest or key, stats[key]))
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_column(justify="right")
    for prefix, rows in groups.items():
        for i, (name, value) in enumerate(rows):
            table.add_row(prefix if i == 0 else "", name, f"{value:.6g}")
    out = Console(file=io.StringIO(), width=120, color_system=None)
    out.print(table)
    return out.file.getvalue().rstrip()
