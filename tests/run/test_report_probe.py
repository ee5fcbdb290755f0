"""``megarl report`` shows the consistency probe's figures: the sampled tokens' gap beside the
full-distribution probe's (``weight_sync/topk_*``), taken from metrics.jsonl."""

from __future__ import annotations

import json

from megarl.run.report import _probe, build_report


def _plot_section(page: str, title: str) -> str:
    return page.split(f"<h2>{title}</h2>")[1].split("</section>")[0]


def test_probe_figures_in_the_report(tmp_path):
    rows = [
        {"global_step": 0, "batch/reward/avg": 0.1},
        {
            "global_step": 1,
            "batch/reward/avg": 0.2,
            "weight_sync/logprob_diff_mean": 2e-5,
            "weight_sync/topk_kl": 3e-9,
            "weight_sync/topk_logprob_diff_max": 4e-5,
            "weight_sync/topk_logprob_diff_mean": 1e-5,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = _plot_section(build_report(tmp_path).read_text(), "Consistency probe")
    for name in ("sampled tokens: mean |Δ|", "top-k tokens: max |Δ|", "top-k KL (server || trainer)"):
        assert json.dumps(name)[1:-1] in section or name in section
    import plotly.graph_objects as go

    title, figure, _ = _probe(go, rows)
    traces = {trace.name: (list(trace.x), list(trace.y)) for trace in figure.data}
    assert traces["top-k tokens: max |Δ|"] == ([2], [4e-5]) and traces["top-k KL (server || trainer)"] == ([2], [3e-9])


def test_no_probe_no_section(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"global_step": 0, "batch/reward/avg": 0.1}) + "\n")
    assert "<h2>Consistency probe</h2>" not in build_report(tmp_path).read_text()
