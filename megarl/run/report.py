"""``megarl report RUN_DIR``: one self-contained HTML page to look at a run.

Built from what a run writes: ``metrics.jsonl`` (one line per step) and, with
``rollout.dump_trajectories``, the dumped trajectories under ``rollout/{version}/``. The page
(``{run_dir}/report.html``, plotly's script inlined, no network needed) holds:

* reward and accuracy curves (``batch/reward/avg``, ``eval/pass@1``);
* the step time by phase (``timeperf/*``), stacked;
* staleness: the trajectories trained per version lag, summed over the run, and per step;
* the train–inference gap per step (``ppo_actor/gap/...``: mean, p99, max; lag 0 apart);
* the consistency probe at each probe: the sampled tokens' mean |Δ logprob| beside the
  full-distribution probe's (``weight_sync/topk_*``: KL and max / mean |Δ| over the top-k tokens);
* the watchdog's events (``watchdog.jsonl``) when there are any;
* a browser of the dumped trajectories: prompt and completion with each token shaded by its
  logprob (or by the row's GRPO advantage, its reward against its group's), reward, versions
  and interruptions (weight updates mid-sequence); filtered by reward and step, and two steps
  side by side.

The trainer writes it at the end of a run and every ``stats_logger.report_every`` steps.
"""

from __future__ import annotations

import html
import json
import logging
import math
from collections import defaultdict
from pathlib import Path

logger = logging.getLogger(__name__)

REPORT_NAME = "report.html"
_PHASES = (
    "rollout",
    "recompute_logp",
    "ref_logp",
    "critic_values",
    "train_step",
    "critic_train",
    "update_weights",
    "save",
    "eval",
)
_MAX_ROWS_PER_STEP = 64  # trajectories of a step kept in the page (the first ones dumped)


def build_report(run_dir: str | Path) -> Path:
    """Write ``{run_dir}/report.html``; returns its path. A clear error when the run has no metrics."""
    import plotly.graph_objects as go  # a dependency of megarl; imported here to keep start-up light

    run_dir = Path(run_dir)
    steps = read_metrics(run_dir)
    trajectories = read_trajectories(run_dir)
    figures = [_curves(go, steps), _phases(go, steps), _staleness(go, steps), _gap(go, steps), _probe(go, steps)]
    sections = []
    for i, (title, figure, note) in enumerate(f for f in figures if f is not None):
        plot = figure.to_html(
            full_html=False,
            include_plotlyjs=(i == 0),
            div_id=f"plot-{i}",
            config={"displaylogo": False, "responsive": True},
        )
        sections.append(
            f'<section class="plot"><h2>{html.escape(title)}</h2><p class="note">{note}</p>{plot}</section>'
        )
    sections.append(_watchdog_section(run_dir))
    sections.append(_browser_section(trajectories))
    page = _PAGE.format(
        title=html.escape(f"megarl report: {run_dir.name}"),
        run_dir=html.escape(str(run_dir.resolve())),
        n_steps=len(steps),
        body="\n".join(sections),
        script=_SCRIPT,
    )
    out = run_dir / REPORT_NAME
    tmp = out.with_suffix(".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)  # a browser reloading the page never reads half of it
    return out


def read_metrics_file(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; a line a crash cut short is skipped with a warning naming it."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            logger.warning("%s line %d is not JSON (%s); skipped", path, number, e.msg)
    return rows


def read_metrics(run_dir: Path) -> list[dict]:
    """The steps of ``metrics.jsonl``, in order; an error naming the file when there is none."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"megarl report: {path} does not exist: is {run_dir} a run directory "
            "({cluster.fileroot}/{experiment_name}/{trial_name}) with at least one step?"
        )
    return read_metrics_file(path)


def read_trajectories(run_dir: Path) -> dict[int, list[dict]]:
    """Dumped training trajectories by version (the step they were handed out at), with group advantages."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    root = run_dir / "rollout"
    if not root.is_dir():
        return {}
    for version_dir in sorted(
        (d for d in root.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name)
    ):
        step = int(version_dir.name)
        for path in sorted(version_dir.glob("*.jsonl"), key=lambda p: p.stem):
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            _add_group_advantages(rows)
            by_step[step] += rows
        by_step[step] = by_step[step][:_MAX_ROWS_PER_STEP]
    return dict(by_step)


def _add_group_advantages(rows: list[dict]) -> None:
    """GRPO's advantage of each row of one episode: its reward against the group's mean and std."""
    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)) if rewards else 0.0
    for row in rows:
        reward = row.get("reward")
        row["advantage"] = None if reward is None else round((reward - mean) / (std + 1e-6), 3)
        versions = [v for v in row.get("versions", []) if v >= 0]
        row["interruptions"] = sum(a != b for a, b in zip(versions, versions[1:]))


def _series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for step in steps:
        if key in step and step[key] is not None:
            xs.append(step.get("global_step", len(xs)) + 1)
            ys.append(step[key])
    return xs, ys


def _step_tick(steps: list[dict]) -> int:
    """Whole steps on the x axis (about 10 ticks)."""
    return max(1, len(steps) // 10)


def _curves(go, steps):
    fig = go.Figure()
    for key, name in (("batch/reward/avg", "reward (trained batch)"), ("eval/pass@1", "pass@1 (evaluation)")):
        xs, ys = _series(steps, key)
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=name))
    if not fig.data:
        return None
    fig.update_layout(xaxis_title="step", yaxis_title="reward / accuracy", height=360)
    fig.update_xaxes(dtick=_step_tick(steps))
    return (
        "Reward and accuracy",
        fig,
        "Mean reward of the trajectories trained on at each step; greedy pass@1 when evaluated.",
    )


def _phases(go, steps):
    fig = go.Figure()
    for phase in _PHASES:
        xs, ys = _series(steps, f"timeperf/{phase}")
        if xs:
            fig.add_trace(go.Bar(x=xs, y=ys, name=phase))
    if not fig.data:
        return None
    fig.update_layout(barmode="stack", xaxis_title="step", yaxis_title="seconds", height=360)
    return "Step time by phase", fig, "Wall seconds of each phase of the step (rank 0)."


def _staleness(go, steps):
    totals: dict[int, float] = defaultdict(float)
    for step in steps:
        for key, value in step.items():
            if key.startswith("rollout/staleness_hist/"):
                totals[int(key.rsplit("/", 1)[1])] += value
    if not totals:
        return None
    lags = sorted(totals)
    fig = go.Figure(go.Bar(x=[str(k) for k in lags], y=[totals[k] for k in lags], name="trajectories"))
    fig.update_layout(
        xaxis_title="version lag (trainer version - oldest token's version)", yaxis_title="trajectories", height=320
    )
    return "Staleness", fig, "Trajectories trained, by how many versions behind the trainer their oldest token was."


def _gap(go, steps):
    fig = go.Figure()
    for key, name in (
        ("ppo_actor/gap/abs_logp_diff/avg", "mean"),
        ("ppo_actor/gap/abs_logp_diff/p99", "p99"),
        ("ppo_actor/gap/abs_logp_diff/max", "max"),
        ("ppo_actor/gap/lag_0/abs_logp_diff/avg", "mean, lag 0"),
    ):
        xs, ys = _series(steps, key)
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=name))
    if not fig.data:
        return None
    fig.update_layout(
        xaxis_title="step", yaxis_title="|trainer logprob - server logprob|", yaxis_type="log", height=360
    )
    fig.update_xaxes(dtick=_step_tick(steps))
    return (
        "Train-inference gap",
        fig,
        "Over the tokens trained at each step (megarl/actor/gap.py); lag 0 is numerics alone.",
    )


def _probe(go, steps):
    fig = go.Figure()
    for key, name in (
        ("weight_sync/logprob_diff_mean", "sampled tokens: mean |Δ|"),
        ("weight_sync/topk_logprob_diff_mean", "top-k tokens: mean |Δ|"),
        ("weight_sync/topk_logprob_diff_max", "top-k tokens: max |Δ|"),
        ("weight_sync/topk_kl", "top-k KL (server || trainer)"),
    ):
        xs, ys = _series(steps, key)
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=name))
    if not fig.data:
        return None
    fig.update_layout(xaxis_title="step", yaxis_title="trainer vs servers", yaxis_type="log", height=360)
    fig.update_xaxes(dtick=_step_tick(steps))
    return (
        "Consistency probe",
        fig,
        "After a weight update, trainer and servers score the probe: its sampled tokens, and the servers' "
        "top-k tokens at each position (weight_update.probe_topk; megarl/bridge/consistency.py).",
    )


def _watchdog_section(run_dir: Path) -> str:
    path = run_dir / "watchdog.jsonl"
    events = []
    if path.is_file():
        events = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not events:
        return '<section id="watchdog"><h2>Watchdog</h2><p class="note">No watchdog event was recorded.</p></section>'
    items = "".join(f"<li>{html.escape(e.get('line') or json.dumps(e))}</li>" for e in events)
    return f'<section id="watchdog"><h2>Watchdog</h2><ul>{items}</ul></section>'


def _browser_section(trajectories: dict[int, list[dict]]) -> str:
    if not trajectories:
        return (
            '<section id="trajectories"><h2>Trajectories</h2><p class="note">None dumped: run with '
            "<code>rollout.dump_trajectories=true</code> to browse what the model generated.</p></section>"
        )
    data = json.dumps({str(step): rows for step, rows in trajectories.items()}).replace("</", "<\\/")
    return f"""<section id="trajectories"><h2>Trajectories</h2>
<p class="note">Each completion token is shaded by the server's logprob (darker: less likely) or by the row's
GRPO advantage (green above its group's mean reward, red below). Filter by reward and step; two steps side by side.</p>
<div class="controls">
  <label>reward &ge; <input id="reward-min" type="number" step="any"></label>
  <label>reward &le; <input id="reward-max" type="number" step="any"></label>
  <label>shade by <select id="shade"><option value="logprob">logprob</option><option value="advantage">advantage</option></select></label>
</div>
<div class="panes">
  <div class="pane"><label>step <select class="step" id="step-a"></select></label><div class="rows" id="rows-a"></div></div>
  <div class="pane"><label>step <select class="step" id="step-b"></select></label><div class="rows" id="rows-b"></div></div>
</div>
<script id="trajectory-data" type="application/json">{data}</script>
</section>"""


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.4em; }} h2 {{ font-size: 1.15em; margin-top: 1.6em; }}
.note {{ color: #555; font-size: 0.9em; }}
.controls label, .pane > label {{ margin-right: 1.2em; }}
.panes {{ display: flex; gap: 1em; }} .pane {{ flex: 1; min-width: 0; }}
.row {{ border: 1px solid #ddd; border-radius: 4px; padding: 0.5em; margin: 0.5em 0; }}
.meta {{ font-size: 0.85em; color: #444; margin-bottom: 0.3em; }}
.prompt {{ white-space: pre-wrap; color: #666; font-family: monospace; font-size: 0.85em; }}
.completion {{ white-space: pre-wrap; font-family: monospace; font-size: 0.85em; }}
.tok.untrained {{ color: #888; }}
</style></head>
<body>
<h1>{title}</h1>
<p class="note">{run_dir}: {n_steps} steps.</p>
{body}
<script>{script}</script>
</body></html>
"""

_SCRIPT = r"""
(function () {
  const node = document.getElementById("trajectory-data");
  if (!node) return;
  const data = JSON.parse(node.textContent);
  const steps = Object.keys(data).map(Number).sort((a, b) => a - b);
  const esc = s => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  function shade(row, i, by) {
    if (by === "advantage") {
      const a = row.advantage || 0, alpha = Math.min(1, Math.abs(a) / 2) * 0.6;
      return a >= 0 ? `rgba(0,160,0,${alpha})` : `rgba(220,0,0,${alpha})`;
    }
    const lp = (row.logprobs || [])[i];
    if (lp === undefined) return "transparent";
    return `rgba(30,90,220,${Math.min(1, -lp / 5) * 0.7})`;
  }
  function render(which) {
    const step = document.getElementById("step-" + which).value;
    const lo = parseFloat(document.getElementById("reward-min").value);
    const hi = parseFloat(document.getElementById("reward-max").value);
    const by = document.getElementById("shade").value;
    const out = document.getElementById("rows-" + which);
    const rows = (data[step] || []).filter(r => (isNaN(lo) || r.reward >= lo) && (isNaN(hi) || r.reward <= hi));
    out.innerHTML = rows.map(r => {
      const toks = (r.tokens || []).map((t, i) =>
        `<span class="tok${(r.trained || [])[i] === 0 ? " untrained" : ""}" title="logprob ${(r.logprobs || [])[i]}, version ${(r.versions || [])[i]}" style="background:${shade(r, i, by)}">${esc(t)}</span>`).join("");
      return `<div class="row" data-reward="${r.reward}" data-step="${step}"><div class="meta">task ${r.task_id} #${r.sample_idx} · reward <b class="reward">${r.reward}</b> · advantage ${r.advantage} · versions ${r.head_version}-${r.tail_version} · interruptions ${r.interruptions} · ${r.seqlen} tokens</div><div class="prompt">${esc(r.prompt || "")}</div><div class="completion">${toks || esc(r.completion || "")}</div></div>`;
    }).join("") || '<p class="note">No trajectory matches.</p>';
  }
  for (const which of ["a", "b"]) {
    const select = document.getElementById("step-" + which);
    select.innerHTML = steps.map(s => `<option value="${s}">${s}</option>`).join("");
    select.value = String(which === "a" ? steps[0] : steps[steps.length - 1]);
    select.addEventListener("change", () => render(which));
  }
  for (const id of ["reward-min", "reward-max", "shade"]) {
    document.getElementById(id).addEventListener("input", () => { render("a"); render("b"); });
  }
  render("a"); render("b");
})();
"""
