"""benchmarks/gpu_kit.sh: per-step time limits, going on after a failure, the summary, skips, and
one end-to-end run of the real kit on a stub CUDA node (fake nvidia-smi, an nvcc wrapper, a
wheel to install, a stale build lock)."""

import ast
import base64
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import types
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks import _harness, fused_logprob
from megarl.kernels import _cuda
from tests.kernels.conftest import mainloops_to_test

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "benchmarks/gpu_kit.sh"
KIT_LIMIT = 540
STUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _kit(outdir: Path, *args: str, kit: Path = KIT, **env: str) -> subprocess.CompletedProcess:
    scratch = outdir.parent
    full = {
        **os.environ,
        "PYTHON": sys.executable,
        # never the real build dir's locks nor /tmp/megarl_site
        "TORCH_EXTENSIONS_DIR": str(scratch / "torch_extensions"),
        "MEGARL_KIT_SITE": str(scratch / "site"),
        **env,
    }
    return subprocess.run(
        ["bash", str(kit), str(outdir), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        env=full,
        cwd=REPO,
    )


def _statuses(outdir: Path) -> dict[str, str]:
    rows = [line.split("|") for line in (outdir / "summary.md").read_text().splitlines() if line.startswith("| ")]
    return {cells[1].strip(): cells[2].strip() for cells in rows if cells[1].strip() != "step"}


def _setup_line(outdir: Path, key: str) -> str:
    """The value of the summary's "- KEY: ..." line."""
    lines = [line for line in (outdir / "summary.md").read_text().splitlines() if line.startswith(f"- {key}: ")]
    assert lines, f"no '- {key}:' line in the summary"
    return lines[0].split(": ", 1)[1]


def _uses_the_gpu_marker(path: Path) -> bool:
    """Whether a test module applies ``pytest.mark.gpu`` (as code: not in a string or comment)."""
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.Attribute) and ast.unparse(node) == "pytest.mark.gpu" for node in ast.walk(tree))


def gpu_marked_files() -> set[str]:
    return {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if _uses_the_gpu_marker(p)}


@pytest.fixture(scope="module")
def dry_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dry") / "out"
    proc = _kit(out, "--dry")
    assert proc.returncode == 0, proc.stderr
    return out


def test_the_dry_run_goes_end_to_end_on_cpu(dry_out):
    assert _statuses(dry_out) == {
        "env": "ok",
        **{s: "skipped: no GPU" for s in ("build", "tests_sm80", "tests_sm90", "kernels", "actor")},
    }
    log = (dry_out / "kit.log").read_text()
    assert "== env (budget 30s)" in log and "torch 2." in log


def test_the_gpu_marker_is_found_in_code_only(tmp_path):
    (tmp_path / "test_a.py").write_text("import pytest\n\npytestmark = [pytest.mark.gpu]\n")
    (tmp_path / "test_b.py").write_text("import pytest\n\n# pytest.mark.gpu\nX = 'pytest.mark.gpu'\n")
    assert _uses_the_gpu_marker(tmp_path / "test_a.py") and not _uses_the_gpu_marker(tmp_path / "test_b.py")
    assert {"tests/kernels/test_kernels_cuda.py", "tests/actor/test_fused_flag.py"} <= gpu_marked_files()


def test_the_budgets_fit_the_kit_limit_and_cover_every_gpu_test_file(dry_out):
    line = _setup_line(dry_out, "budgets (s)")
    budgets = dict(re.findall(r"(\S+)=(\d+)", line))
    total = int(re.search(r"\(sum (\d+) of 540\)", line).group(1))
    assert sum(map(int, budgets.values())) == total <= KIT_LIMIT
    assert {"setup", "env", "build", "kernels", "actor"} <= budgets.keys()
    for step in ("tests_sm80", "tests_sm90"):
        assert {k.split(":", 1)[1] for k in budgets if k.startswith(step + ":")} == gpu_marked_files()


def test_the_kit_refuses_budgets_over_its_limit(tmp_path):
    proc = _kit(tmp_path / "out", "--dry", MEGARL_KIT_BUDGET_build="400")
    assert proc.returncode == 2
    assert "the budgets sum to 800s, over the kit's 540s" in proc.stderr


def test_a_failed_or_hung_step_does_not_stop_the_next_and_each_is_recorded_when_it_ends(tmp_path):
    out = tmp_path / "out"
    # `check` runs after the others: it passes only if their output and summary lines are
    # already in OUTDIR while the kit is still running
    check = (
        f'grep -q "output of fail" {out}/kit.log && grep -q "| fail | failed (rc 3)" {out}/summary.md && '
        f'grep -q "| hang | timed out after 2s" {out}/summary.md'
    )
    start = time.monotonic()
    proc = _kit(
        out,
        MEGARL_KIT_STEPS="fail hang check build",
        MEGARL_KIT_DRY="1",
        MEGARL_KIT_CMD_fail="echo output of fail; exit 3",
        MEGARL_KIT_CMD_hang="sleep 60",
        MEGARL_KIT_BUDGET_hang="2",
        MEGARL_KIT_CMD_check=check,
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 30  # the hung step was cut at its budget
    assert _statuses(out) == {
        "fail": "failed (rc 3)",
        "hang": "timed out after 2s",
        "check": "ok",
        "build": "skipped: no GPU",
    }


def test_without_megatron_core_the_actor_step_says_how_to_get_it(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexit 1\n")  # no module imports, megatron.core included
    fake_python.chmod(0o755)
    proc = _kit(tmp_path / "out", PYTHON=str(fake_python), MEGARL_KIT_STEPS="actor", MEGARL_KIT_DRY="0")
    assert proc.returncode == 0, proc.stderr
    assert _statuses(tmp_path / "out") == {"actor": "skipped: megatron-core not installed (run the wheel script)"}


def test_the_prepared_call_runs_its_steps_within_the_limit_dry(tmp_path):
    out = tmp_path / "out"
    proc = _kit(out, "--call", "--dry", MEGARL_KIT_WHEELS_DIR=str(tmp_path / "no_wheels"))
    assert proc.returncode == 0, proc.stderr
    skipped = ("build", "tests_sm90", "forward_sweep", "ncu_forward", "train_grid", "actor_28l", "bridge_smoke")
    assert _statuses(out) == {"env": "ok", **{step: "skipped: no GPU" for step in skipped}}
    line = _setup_line(out, "budgets (s)")
    budgets = dict(re.findall(r"(\S+)=(\d+)", line))
    assert sum(map(int, budgets.values())) == int(re.search(r"\(sum (\d+) of 540\)", line).group(1)) <= KIT_LIMIT
    assert "tests_sm80" not in line and (out / "summary.md").read_text().startswith("# GPU kit (the prepared call)")


def _ncu_step(out: Path, **env: str) -> subprocess.CompletedProcess:
    """The prepared call's ncu_forward step alone, on a node that says it has a GPU."""
    no_wheels = str(out.parent / "no_wheels")
    return _kit(
        out, "--call", MEGARL_KIT_DRY="0", MEGARL_KIT_STEPS="ncu_forward", MEGARL_KIT_WHEELS_DIR=no_wheels, **env
    )


def test_the_ncu_step_is_skipped_by_name_where_nsight_compute_is_missing(tmp_path):
    out = tmp_path / "out"
    bin_dir = tmp_path / "bin"  # bash and the coreutils, no ncu
    bin_dir.mkdir()
    tools = ("bash", "date", "mkdir", "cat", "awk", "tr", "find", "sort", "git", "head", "sed", "timeout")
    for tool in (*tools, "dirname", "basename", "wc", "realpath", "hostname", "grep", "rm", "tail", "env", "tar"):
        if found := shutil.which(tool):
            (bin_dir / tool).symlink_to(found)
    proc = _ncu_step(out, PATH=str(bin_dir))
    assert proc.returncode == 0, proc.stderr
    assert _statuses(out) == {"ncu_forward": "skipped: ncu (Nsight Compute) not on PATH"}


def test_the_ncu_step_profiles_the_old_order_then_the_default(tmp_path):
    """The step's own command, with an ncu on PATH that records how it was called."""
    out, bin_dir = tmp_path / "out", tmp_path / "bin"
    bin_dir.mkdir()
    ncu = bin_dir / "ncu"
    ncu.write_text('#!/bin/bash\necho "ncu group=${MEGARL_CUDA_CTA_GROUP:-unset} $*"\n')
    ncu.chmod(0o755)
    proc = _ncu_step(
        out,
        MEGARL_CUDA_CTA_GROUP="7",  # the operator's setting must not leak into the default run
        PATH=f"{bin_dir}:{os.environ['PATH']}",
    )
    assert proc.returncode == 0, proc.stderr
    assert _statuses(out) == {"ncu_forward": "ok"}
    calls = [line for line in (out / "ncu_forward.txt").read_text().splitlines() if line.startswith("ncu ")]
    assert [call.split()[1] for call in calls] == ["group=1", "group=unset"]
    assert all("--clock-control none" in call and "dram__bytes_read.sum" in call for call in calls)
    assert all(
        call.endswith("-m benchmarks.profile_forward --tokens 16384 --hidden 4096 --vocab 32768 --repeats 1")
        for call in calls
    )


def test_the_prepared_call_brings_back_at_most_eight_files_json_records_kept(tmp_path):
    out = tmp_path / "out"
    # each step writes two records and two tables: 12 files, the summary and kit.log
    write = 'for i in 1 2; do echo "{}" > "$OUTDIR/${MEGARL_KIT_STEP}_$i.json"; echo t > "$OUTDIR/${MEGARL_KIT_STEP}_$i.md"; done'
    steps = "env train_grid actor_28l"
    proc = _kit(
        out,
        "--call",
        MEGARL_KIT_DRY="0",
        MEGARL_KIT_STEPS=steps,
        MEGARL_KIT_WHEELS_DIR=str(tmp_path / "no_wheels"),
        **{f"MEGARL_KIT_CMD_{step}": write for step in steps.split()},
    )
    assert proc.returncode == 0, proc.stderr
    records = [f"{step}_{i}.json" for step in steps.split() for i in (1, 2)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*records, "summary.md", "rest.tar.gz"])
    with tarfile.open(out / "rest.tar.gz") as tar:
        bundled = set(tar.getnames())
    assert bundled == {"kit.log", *(name.replace(".json", ".md") for name in records)}
    assert "kit.log" in bundled and "train_grid_2.md" in bundled
    assert "bundled into rest.tar.gz" in (out / "summary.md").read_text()


@pytest.mark.parametrize("args", [[], ["out", "--wet"], ["out", "--dry", "extra"], ["out", "--dry", "--call", "x"]])
def test_bad_arguments_print_the_usage(tmp_path, args):
    proc = subprocess.run(
        ["bash", str(KIT), *args], check=False, capture_output=True, text=True, cwd=tmp_path, timeout=30
    )
    assert proc.returncode == 2 and "usage: bash benchmarks/gpu_kit.sh OUTDIR [--dry] [--call]" in proc.stderr


# ---------------------------------------------------------------- the real kit on a stub CUDA node


def _write_wheel(folder: Path, name: str = "megarl_stub_pkg", version: str = "0.1") -> Path:
    """A valid pure-Python wheel of a package that nothing else installs."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"MARK = 'stub'\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _stub_node(root: Path) -> dict[str, str]:
    """Fake nvidia-smi; nvcc as a wrapper script whose directory has no CUDA headers, but whose
    --dryrun names a toolkit that has them; a python that records who calls it (the step, the
    mainloop, where the stub wheel's package imports from) and stands in for pytest."""
    toolkit = root / "cuda-13.0"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include/cuda_runtime_api.h").write_text("/* stub */\n")
    bin_dir = root / "wrappers/bin"
    bin_dir.mkdir(parents=True)
    _script(
        bin_dir / "nvidia-smi",
        '#!/bin/sh\ncase "$*" in *--query-gpu*) echo "580.65.06" ;; *) echo "NVIDIA H100 80GB HBM3 (stub)" ;; esac\n',
    )
    _script(
        bin_dir / "nvcc",
        f'#!/bin/sh\ncase "$*" in\n  *--dryrun*) echo "#$ _HERE_={toolkit}/bin"; echo "#$ TOP={toolkit}/bin/.." ;;\n'
        '  *) echo "Cuda compilation tools, release 13.0, V13.0.88" ;;\nesac\n',
    )
    calls = root / "calls.txt"
    _script(
        bin_dir / "python",
        f'#!/bin/sh\nstub=$("{sys.executable}" -c "import megarl_stub_pkg; print(megarl_stub_pkg.__file__)" 2>/dev/null)\n'
        f'echo "$MEGARL_KIT_STEP|$MEGARL_CUDA_MAINLOOP|$stub|$$|$*" >> "{calls}"\n'
        'if [ "$1 $2" = "-m pytest" ]; then exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n',
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "MEGARL_CUDA_MAINLOOP")}
    return {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python")}


def _stub_repo(root: Path, kit: Path) -> Path:
    """The repository without .git, with the kit under test and a wheel in .whl/."""
    repo = root / "repo"
    repo.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".git", ".whl", "benchmarks"):
            (repo / entry.name).symlink_to(entry)
    (repo / "benchmarks").mkdir()
    for entry in (REPO / "benchmarks").iterdir():
        if entry.name != "gpu_kit.sh":
            (repo / "benchmarks" / entry.name).symlink_to(entry)
    (repo / "benchmarks/gpu_kit.sh").write_bytes(kit.read_bytes())
    _write_wheel(repo / ".whl")
    return repo


# what each stubbed step does: import the stub package (through the recording python), and the
# kernels and actor steps write their tables; build fails
STUB_STEPS = {
    "MEGARL_KIT_CMD_build": '"$PY" -c "import megarl_stub_pkg"; exit 1',
    "MEGARL_KIT_CMD_kernels": '"$PY" -c "import megarl_stub_pkg" && echo "{}" > "$OUTDIR/fused_logprob_gpu.json"',
    "MEGARL_KIT_CMD_actor": '"$PY" -c "import megarl_stub_pkg" && echo "{}" > "$OUTDIR/actor_step_gpu.json"',
}


@pytest.fixture(scope="module")
def stub_run(tmp_path_factory) -> dict:
    """The kit of this checkout (or MEGARL_TEST_KIT) run once, not dry, on the stub node."""
    root = tmp_path_factory.mktemp("stub_node")
    env = _stub_node(root)
    repo = _stub_repo(root, Path(os.environ.get("MEGARL_TEST_KIT", KIT)))
    stale = root / "torch_extensions/megarl_C/lock"
    other = root / "torch_extensions/other_ext/lock"
    for lock in (stale, other):
        lock.parent.mkdir(parents=True)
        lock.write_text("")
    env.update(STUB_STEPS)
    out, proc = _run_stub_kit(root, repo, env)
    calls = [line.split("|", 4) for line in (root / "calls.txt").read_text().splitlines()]
    return {"root": root, "out": out, "proc": proc, "calls": calls, "stale": stale, "other": other}


def _run_stub_kit(root: Path, repo: Path, env: dict) -> tuple[Path, subprocess.CompletedProcess]:
    """The kit, not dry, on the stub node: (OUTDIR, the finished process), which must succeed."""
    env = {
        **env,
        "MEGARL_COMMIT": STUB_COMMIT,
        "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions"),
        "MEGARL_KIT_SITE": str(root / "site"),
        "MEGARL_KIT_DRY": "0",
    }
    out = root / "out"
    cmd = ["bash", str(repo / "benchmarks/gpu_kit.sh"), str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


def _step_calls(stub_run: dict) -> dict[str, list[list[str]]]:
    """The recorded python calls of each step (by MEGARL_KIT_STEP), in order."""
    by_step: dict[str, list[list[str]]] = {}
    for call in stub_run["calls"]:
        if call[0]:
            by_step.setdefault(call[0], []).append(call)
    return by_step


def _expected_steps() -> list[str]:
    return [
        "env",
        "build",
        *["tests_sm80"] * len(gpu_marked_files()),
        *["tests_sm90"] * len(gpu_marked_files()),
        "kernels",
        "actor",
    ]


def test_every_step_sees_the_installed_wheel(stub_run):
    site = stub_run["root"] / "site"
    by_step = _step_calls(stub_run)
    assert sorted(step.split()[0] for step in by_step) == sorted(_expected_steps())
    for step, calls in by_step.items():
        assert all(call[2] == str(site / "megarl_stub_pkg/__init__.py") for call in calls), (step, calls)
    assert "megarl_stub_pkg-0.1-py3-none-any.whl" in _setup_line(stub_run["out"], "wheels")


def test_cuda_home_is_the_toolkit_nvcc_reports(stub_run):
    toolkit = str(stub_run["root"] / "cuda-13.0")
    assert _setup_line(stub_run["out"], "CUDA_HOME") == f"{toolkit} (from nvcc --dryrun)"
    assert f"CUDA_HOME={toolkit} " in (stub_run["out"] / "kit.log").read_text()  # the env step's line


def test_sm80_tests_run_first_with_the_mainloop_forced_one_process_per_file(stub_run):
    pytest_calls = [call for call in stub_run["calls"] if call[4].startswith("-m pytest")]
    files = sorted(gpu_marked_files())
    ran = [(call[0].split()[0], call[1]) for call in pytest_calls]
    assert ran == [("tests_sm80", "sm80")] * len(files) + [("tests_sm90", "auto")] * len(files)
    for step in ("tests_sm80", "tests_sm90"):  # each file named, once per step
        named = [call[4].split()[-1] for call in pytest_calls if call[0] == f"{step} {call[4].split()[-1]}"]
        assert sorted(named) == files
    assert len({call[3] for call in pytest_calls}) == len(pytest_calls)  # one process each
    statuses = _statuses(stub_run["out"])
    assert all(statuses[f"{step} {f}"] == "ok" for step in ("tests_sm80", "tests_sm90") for f in files)


def test_a_failing_step_leaves_the_others_results(stub_run):
    statuses = _statuses(stub_run["out"])
    assert [step.split()[0] for step in statuses] == _expected_steps()
    assert statuses["build"] == "failed (rc 1)"
    assert all(status == "ok" for step, status in statuses.items() if step != "build")
    assert (stub_run["out"] / "fused_logprob_gpu.json").exists() and (stub_run["out"] / "actor_step_gpu.json").exists()


def test_stale_build_locks_of_megarl_are_removed_and_logged(stub_run):
    assert not stub_run["stale"].exists() and stub_run["other"].exists()
    assert str(stub_run["stale"]) in _setup_line(stub_run["out"], "stale build locks removed")


def test_the_summary_names_the_commit_without_git(stub_run):
    assert _setup_line(stub_run["out"], "commit") == f"{STUB_COMMIT} (from $MEGARL_COMMIT)"


# ---------------------------------------------------------------- what the steps run


def test_an_explicit_mainloop_in_the_environment_is_the_only_one_tested(monkeypatch):
    monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", "sm80")
    assert mainloops_to_test() == ("sm80",)
    monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", "auto")
    assert mainloops_to_test() == ("sm80", "sm90")
    monkeypatch.delenv("MEGARL_CUDA_MAINLOOP")
    assert mainloops_to_test() == ("sm80", "sm90")


def test_a_failing_benchmark_variant_is_a_row_with_its_error_and_the_table_is_written(tmp_path, monkeypatch):
    def measure(variant, hidden, weight, labels, backward, repeats):
        if variant == "cuda_sm80":
            raise RuntimeError("an illegal instruction was encountered")
        return [2.0, 1.5, 3.0], 10.0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "stub GPU")
    monkeypatch.setattr(fused_logprob, "GPU_SHAPES_QUICK", [(128, 64, 256)])
    monkeypatch.setattr(fused_logprob, "_inputs", lambda T, H, V, dtype, device: (None, None, None))
    monkeypatch.setattr(fused_logprob, "_cuda_variants", lambda: ["cuda_sm80", "cuda"])
    monkeypatch.setattr(fused_logprob, "_measure_gpu", measure)
    monkeypatch.setattr(_harness, "gpu_driver_version", lambda: "580.65.06")
    # the wgmma mainloop failed its self-check: the "cuda" row must say the sm80 one ran
    fallback = "cuda sm80 (verified: max |diff| 1e-07; sm90 failed its self-check: RuntimeError: trap)"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_cuda, "active_path", lambda device=None: "sm80")
    monkeypatch.setattr(_cuda, "verified_path", lambda device: types.SimpleNamespace(describe=lambda: fallback))
    _harness.run_benchmark("fused_logprob", quick=True, results_dir=tmp_path)
    record = json.loads((tmp_path / "fused_logprob_gpu.json").read_text())
    rows = {row["variant"]: row for row in record["rows"]}
    assert list(rows) == ["matmul", "naive", "chunked", "cuda_sm80", "cuda", *fused_logprob.GPU_TRAIN_VARIANTS]
    assert rows["cuda_sm80"]["error"] == "RuntimeError: an illegal instruction was encountered"
    assert rows["cuda_sm80"]["fwd_ms"] is None and rows["cuda"]["fwd_ms"] == 2.0 and "error" not in rows["cuda"]
    assert (rows["cuda"]["fwd_ms_min"], rows["cuda"]["fwd_ms_max"]) == (1.5, 3.0)
    assert rows["cuda"]["kernel_path"] == "sm80" and rows["cuda"]["selfcheck"] == fallback
    assert "kernel_path" not in rows["matmul"] and rows["train"]["kernel_path"] == "sm80"
    assert "kernel_path" not in rows["train_torch"]  # torch's ops: no mainloop to name
    assert "partial" not in record and record["versions"]["megarl"]
    assert rows["cuda"]["fwd_vs_matmul"] == 1.0
    machine = record["machine"]
    assert machine["gpu"] == "stub GPU" and machine["gpu_driver"] == "580.65.06"
    assert machine["torch"] == torch.__version__ and machine["commit"].startswith(_git_head())


def test_the_train_grid_runs_the_tp1_shapes_with_the_training_path_variants(tmp_path, monkeypatch):
    seen = []

    def measure(variant, hidden, weight, labels, backward, repeats):
        seen.append((variant, backward, repeats))
        return [2.0] * repeats, 10.0

    monkeypatch.setenv("MEGARL_FUSED_GRID", "train")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "stub GPU")
    monkeypatch.setattr(fused_logprob, "GPU_SHAPES", [(128, 64, 256), (256, 64, 512)])
    monkeypatch.setattr(fused_logprob, "_inputs", lambda T, H, V, dtype, device: (None, None, None))
    monkeypatch.setattr(fused_logprob, "_measure_gpu", measure)
    monkeypatch.setattr(fused_logprob, "_path_taken", lambda variant: {})
    monkeypatch.setattr(_harness, "gpu_driver_version", lambda: "580.65.06")
    _harness.run_benchmark("fused_logprob", quick=False, results_dir=tmp_path)
    rows = json.loads((tmp_path / "fused_logprob_gpu_train.json").read_text())["rows"]  # not the full grid's file
    assert {row["tp"] for row in rows} == {1} and len(rows) == 2 * 6
    assert [row["variant"] for row in rows[:6]] == ["matmul", "cuda", *fused_logprob.GPU_TRAIN_VARIANTS]
    # the training path has no forward alone; every timed pass is 10 repeats
    assert ("train", False, 10) not in seen and ("train", True, 10) in seen and {r for *_, r in seen} == {10}


@pytest.mark.parametrize("variant", fused_logprob.GPU_TRAIN_VARIANTS)
def test_each_training_path_variant_gives_the_gradients_of_the_default_one(variant):
    """The variants differ in chunking and ops only: the same loss's gradients (fp32, on the host)."""
    hidden, weight, labels = fused_logprob._inputs(40, 16, 96, torch.float32, "cpu")
    grads = {}
    for name in ("train@7", variant):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        fused_logprob._train_step(name, h, w, labels, backward=True)
        grads[name] = (h.grad, w.grad)
    for ours, reference in zip(grads[variant], grads["train@7"], strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_a_benchmark_stopped_by_sigterm_keeps_the_rows_it_has(tmp_path, monkeypatch):
    """The kit's `timeout` sends SIGTERM: the rows measured so far are still written."""

    def measure(variant, hidden, weight, labels, backward, repeats):
        if variant == "chunked":
            os.kill(os.getpid(), signal.SIGTERM)
        return [2.0, 1.5, 3.0], 10.0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "stub GPU")
    monkeypatch.setattr(fused_logprob, "GPU_SHAPES_QUICK", [(128, 64, 256)])
    monkeypatch.setattr(fused_logprob, "_inputs", lambda T, H, V, dtype, device: (None, None, None))
    monkeypatch.setattr(fused_logprob, "_cuda_variants", lambda: ["cuda"])
    monkeypatch.setattr(fused_logprob, "_measure_gpu", measure)
    # An earlier test in this process may have installed megarl's own SIGTERM handler: whatever was
    # there before the benchmark is what must be there after it.
    before = signal.getsignal(signal.SIGTERM)
    _harness.run_benchmark("fused_logprob", quick=True, results_dir=tmp_path)
    rows = json.loads((tmp_path / "fused_logprob_gpu.json").read_text())["rows"]
    assert [row.get("variant") for row in rows] == ["matmul", "naive", None]
    assert rows[-1]["error"].startswith("stopped by SIGTERM")
    assert signal.getsignal(signal.SIGTERM) is before


def _git_head() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def test_results_name_the_commit_or_megarl_commit_without_git(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGARL_COMMIT", raising=False)
    assert _harness.source_commit().startswith(_git_head())
    monkeypatch.setattr(_harness, "REPO", tmp_path)  # a copy without .git
    assert _harness.source_commit() is None
    monkeypatch.setenv("MEGARL_COMMIT", STUB_COMMIT)
    assert _harness.source_commit() == STUB_COMMIT


def test_megarl_commit_wins_over_a_copied_trees_older_git_head(monkeypatch):
    """A tree copied to a GPU node with a .git naming an older HEAD recorded that HEAD + "-dirty"
    (seen on the first H200 run): the commit said in so many words is the one recorded."""
    monkeypatch.setenv("MEGARL_COMMIT", STUB_COMMIT)
    assert _git_head() and _harness.source_commit() == STUB_COMMIT


class _Killed(BaseException):
    """The kit's step budget ending the process (SIGKILL leaves no handler a chance to run)."""


def test_an_actor_step_killed_in_its_second_row_keeps_the_first_on_disk(tmp_path, monkeypatch):
    from benchmarks import actor_step

    def rows(name, shape, fused, steps, profile):
        if fused:
            raise _Killed
        return [{"shape": name, "impl": "megatron", "fused_kernels": False, "step_s": 2.0, "kernel_path": "torch"}]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "stub GPU")
    monkeypatch.setattr(_harness, "gpu_driver_version", lambda: "580.65.06")
    monkeypatch.setattr(actor_step, "_rows_in_own_process", rows)
    with pytest.raises(_Killed):
        _harness.run_benchmark("actor_step", quick=True, results_dir=tmp_path)
    record = json.loads((tmp_path / "actor_step_gpu.json").read_text())
    assert [r["fused_kernels"] for r in record["rows"]] == [False] and record["rows"][0]["kernel_path"] == "torch"
    assert record["partial"].startswith("the run ended before its last row")
    assert "Partial: " in (tmp_path / "actor_step_gpu.md").read_text()
    assert record["versions"]["megarl"] and record["machine"]["gpu"] == "stub GPU"


def test_the_summary_checks_the_build_tools_and_the_version_set(stub_run):
    """torch's JIT build runs ninja from PATH and $CUDA_HOME/bin/nvcc: the stub toolkit has no
    bin/nvcc (only the wrapper on PATH does), which the summary must say before a build fails."""
    assert _setup_line(stub_run["out"], "nvcc").endswith(
        "cuda-13.0/bin/nvcc is missing or not executable (torch's JIT build runs that one, not PATH's)"
    )
    assert _setup_line(stub_run["out"], "ninja").startswith(("/", "not found on PATH"))
    report = _setup_line(stub_run["out"], "version set (.ci/constraints-gpu.txt)")
    assert "megatron-core: " in report and "torch: " in report and "vllm: " in report


def test_a_build_killed_by_its_budget_leaves_no_lock_for_the_next_step(tmp_path):
    root = tmp_path
    env = _stub_node(root)
    repo = _stub_repo(root, KIT)
    extensions = root / "torch_extensions"
    env.update(
        MEGARL_KIT_STEPS="build",
        MEGARL_KIT_BUDGET_build="2",
        # what a JIT build does first: take its lock; then it outlives the step's budget
        MEGARL_KIT_CMD_build='mkdir -p "$TORCH_EXTENSIONS_DIR/megarl_C" && touch "$TORCH_EXTENSIONS_DIR/megarl_C/lock" && sleep 60',
    )
    out, _ = _run_stub_kit(root, repo, env)
    line = next(line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| build |"))
    assert f"timed out after 2s; build lock removed: {extensions}/megarl_C/lock" in line
    assert not (extensions / "megarl_C/lock").exists()


def test_no_gpu_test_reaches_the_wgmma_kernel_without_asking_which_mainloops_run():
    """The kit's tests_sm80 step forces the mma.sync mainloop: a GPU test that launches (or
    probes) the wgmma kernel must first ask ``mainloops_to_test`` whether sm90 runs at all."""
    source = (REPO / "tests/kernels/test_kernels_cuda.py").read_text()
    unguarded = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name != "skip_without_wgmma":
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if names & {"skip_without_wgmma", "wgmma"} and "mainloops_to_test" not in names:
                unguarded.append(node.name)
    assert not unguarded, f"reach the wgmma kernel whatever MEGARL_CUDA_MAINLOOP says: {unguarded}"
