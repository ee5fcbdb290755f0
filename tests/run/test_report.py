"""``megarl report``: the run's HTML page, checked in a real browser (Playwright driving Debian's chromium)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megarl.launcher.cli import main
from megarl.run.report import build_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
STEPS = 6


def _write_run(run_dir: Path) -> Path:
    """A run directory as a trainer writes it: metrics.jsonl and dumped trajectories of steps 1 and 2."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(STEPS):
        row = {
            "epoch": 0,
            "epoch_step": step,
            "global_step": step,
            "batch/reward/avg": 0.2 + 0.1 * step,
            "timeperf/rollout": 5.0,
            "timeperf/train_step": 3.0 + step,
            "timeperf/update_weights": 1.0,
            "rollout/staleness_hist/0": 6.0,
            "rollout/staleness_hist/1": 2.0,
            "ppo_actor/gap/abs_logp_diff/avg": 1e-3,
            "ppo_actor/gap/abs_logp_diff/p99": 5e-3,
            "ppo_actor/gap/abs_logp_diff/max": 1e-2,
            "ppo_actor/gap/lag_0/abs_logp_diff/avg": 8e-4,
        }
        if step % 2 == 1:
            row["eval/pass@1"] = 0.1 * step
        lines.append(json.dumps(row))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for version, rewards in ((1, [1.0, 0.0, 1.0, 0.0]), (2, [1.0, 1.0, 0.0, 1.0])):
        folder = run_dir / "rollout" / str(version)
        folder.mkdir(parents=True)
        rows = [
            {
                "task_id": 10 * version,
                "sample_idx": i,
                "seqlen": 7,
                "prompt_len": 4,
                "head_version": version - 1,
                "tail_version": version,
                "reward": r,
                "prompt": "2+2=",
                "completion": f"<{i}>",
                "tokens": ["4", "</s>", "!"],
                "logprobs": [-0.1, -2.5, -0.01],
                "trained": [1, 1, 1],
                "versions": [version - 1, version, version],
            }
            for i, r in enumerate(rewards)
        ]
        (folder / f"{10 * version}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_report_sections_and_group_advantages(tmp_path):
    page = build_report(_write_run(tmp_path / "run")).read_text()
    for title in ("Reward and accuracy", "Step time by phase", "Staleness", "Train-inference gap", "Trajectories"):
        assert f"<h2>{title}</h2>" in page
    assert page.count("plotly.js v") == 1, "plotly's script is inlined once"
    assert "<script src=" not in page and "No watchdog event was recorded" in page, "self-contained: no external script"
    data = json.loads(page.split('<script id="trajectory-data" type="application/json">')[1].split("</script>")[0])
    assert sorted(data) == ["1", "2"]
    assert [r["advantage"] for r in data["1"]] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-3)  # reward vs group
    assert all(r["interruptions"] == 1 for r in data["1"]), "a version change mid-completion is an interruption"
    script = page.split('<script id="trajectory-data" type="application/json">')[1].split("</script>")[0]
    assert "</s>" not in script and "<\\/s>" in script, "a token cannot close the data's script element"


def test_truncated_last_line_is_skipped(tmp_path, caplog):
    run_dir = _write_run(tmp_path / "run")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"global_step": 6, "batch/rew')
    with caplog.at_level("WARNING"):
        build_report(run_dir)
    assert f"line {STEPS + 1} is not JSON" in caplog.text


def test_cli_names_a_missing_run(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    assert main(["report", str(_write_run(tmp_path / "run"))]) == 0
    assert "report.html" in capsys.readouterr().out


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make system-deps, as root)")
def test_page_renders_curves_and_filters_trajectories_in_a_browser(tmp_path):
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) is not installed")
    page_path = build_report(_write_run(tmp_path / "run"))
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_path.as_uri())
            page.wait_for_selector("#plot-0 .main-svg")
            # every figure drew its traces: reward + pass@1, 3 phases, the staleness bars, 4 gap lines
            traces = page.evaluate("[0, 1, 2, 3].map(i => document.getElementById('plot-' + i).data.length)")
            assert traces == [2, 3, 1, 4]
            assert page.locator("#plot-0 .scatterlayer .trace").count() == 2, "the reward curves are drawn"
            assert page.locator("#plot-1 .barlayer .trace").count() == 3
            # the two panes start on the first and the last step, 4 rows each
            assert page.locator("#rows-a .row").count() == 4 and page.locator("#rows-b .row").count() == 4
            assert set(page.locator("#rows-b .row").evaluate_all("rows => rows.map(r => r.dataset.step)")) == {"2"}
            page.fill("#reward-min", "1")
            rewards = page.locator("#rows-a .row").evaluate_all("rows => rows.map(r => Number(r.dataset.reward))")
            assert rewards == [1.0, 1.0], "the filter keeps rewards >= 1 only"
            assert page.locator("#rows-b .row").count() == 3
            page.select_option("#step-a", "2")
            assert page.locator("#rows-a .row").count() == 3
            page.fill("#reward-min", "")
            page.fill("#reward-max", "0")
            assert page.locator("#rows-a .row").count() == 1
            shaded = page.locator("#rows-a .tok").first.evaluate("t => getComputedStyle(t).backgroundColor")
            assert shaded.startswith("rgba(30, 90, 220"), shaded
            assert not errors, errors
        finally:
            browser.close()


def test_watchdog_events_read_as_their_lines(tmp_path):
    """The report shows each watchdog event as the console line that named it."""
    run_dir = _write_run(tmp_path / "run")
    line = "megarl watchdog: trainer-1 in phase 'train_step' for 31 s (budget 30 s); stacks in stacks/"
    (run_dir / "watchdog.jsonl").write_text(
        json.dumps({"kind": "overdue", "names": ["trainer-1"], "line": line}) + "\n"
    )
    page = build_report(run_dir).read_text()
    assert "<li>megarl watchdog: trainer-1 in phase &#x27;train_step&#x27; for 31 s" in page
