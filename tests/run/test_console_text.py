"""What the trainer prints on the console (``megarl.run.console_text``)."""

from __future__ import annotations

import torch

from megarl.run.console_text import kernel_line, start_lines, step_line


def test_the_console_names_the_kernel_path_and_a_mainloop_that_failed_its_self_check(monkeypatch):
    """On a GPU the start-up line says which fused-kernel path runs; a fallback (here: a wrong sm90
    kernel, planted as a failing self-check) is on it, naming the mainloop and why. None on a CPU."""
    from megarl.kernels import _cuda, backend
    from megarl.kernels.selfcheck import CheckResult

    assert kernel_line("auto") is None or torch.cuda.is_available()
    checks = {
        "sm90": CheckResult("sm90", 0.5, "dz", 40.0, error="dz beyond its tolerance by 40x"),
        "sm80": CheckResult("sm80", 1e-7, "dz", 0.01),
    }
    monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "_current_cuda_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(_cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(_cuda, "_sm90_available", lambda device_index: True)
    monkeypatch.setattr(_cuda, "_CHECKS", {})
    monkeypatch.setattr(_cuda, "_PATHS", {})
    monkeypatch.setattr(_cuda, "_self_check", lambda device, mainloop: checks[mainloop])
    line = kernel_line("auto")
    assert line.startswith("fused kernels: cuda sm80 (verified"), line
    assert "sm90 failed its self-check: dz beyond its tolerance by 40x" in line
    assert kernel_line("torch") is None


def test_step_line_shows_the_failed_rewards():
    """Occasional reward failures (raised, timed out) are on the step's console line, and only then."""
    stats = {"batch/reward/avg": 0.25, "rollout/reward/n_calls": 16.0, "rollout/reward/error": 2.0}
    assert "reward 0.250  failed rewards: 2 errors in 16 calls" in step_line(0, 3, stats)
    stats["rollout/reward/timeout"] = 1.0
    assert "failed rewards: 2 errors, 1 timeout in 16 calls" in step_line(0, 3, stats)
    assert "failed" not in step_line(0, 3, {"batch/reward/avg": 0.25, "rollout/reward/n_calls": 16.0})


def test_step_line_shows_the_distance_to_a_teacher_when_distilling():
    stats = {"batch/reward/avg": 0.0, "teacher/reverse_kl/avg": 0.3146, "eval/pass@1": 0.5}
    assert "reward 0.000  teacher KL 0.315  pass@1 0.500" in step_line(4, 15, stats)
    assert "teacher" not in step_line(4, 15, {"batch/reward/avg": 0.25})


def test_step_line_shows_the_train_phases_throughput_and_mfu_where_measured():
    stats = {"batch/reward/avg": 0.25, "timeperf/step": 3.0, "perf/train_tokens_per_s": 12345.6}
    assert step_line(0, 3, stats).endswith("  train 12,346 tok/s")
    stats["perf/mfu"] = 0.384
    assert step_line(0, 3, stats).endswith("  train 12,346 tok/s MFU 0.38")
    assert "tok/s" not in step_line(0, 3, {"batch/reward/avg": 0.25})


def test_start_lines_name_the_skipped_rows_on_a_cpu():
    assert start_lines("torch", []) == []
    assert start_lines("torch", ["row 3: no answer", "row 9: too long"]) == [
        "dataset: skipped 2 bad rows (bad_rows: skip); the first: row 3: no answer"
    ]
