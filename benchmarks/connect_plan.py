"""The weight bridge's connect-time planning at N inference servers: what trainer rank 0 computes
before the servers join, and how big each server's init body is.

``WeightBridge.connect`` builds the transfer plan (``build_plan``), the broadcast and sharded
schedules, and on rank 0 one init body per server (``WeightBridge._init_info``: the wiring and
every worker's receive specs), which ``init_group`` posts to the server. This benchmark runs
exactly those steps (the bridge's own ``_init_info`` on a ``WeightBridge`` whose servers are
stand-ins; no process group, no server) for

* a dense Qwen2.5-7B-shaped model under the trainer layout of
  ``configs/gsm8k_grpo_qwen2.5-7b_128gpu.yaml`` (``megatron:d16p1t4``), and
* a Qwen3-30B-A3B-shaped MoE (48 layers, 128 experts, top-8, hidden 2048, expert FFN 768,
  vocabulary 151936) under ``configs/gsm8k_grpo_qwen3-30b-a3b_256gpu.yaml``'s (``megatron:d16p2t4e8et1``),

each to 8, 64 and 256 servers of TP 4 (1,024 inference workers at 256), in ``sharded`` and
``broadcast`` mode, with the GPU's 1 GiB buckets and bf16 on the wire. The models are described
from their HF configs (megarl's own ``describe``) with the HF tensor shapes derived from the
config: no weights.

Per row, in its own process (torch on one thread: the planning is serial Python and a shared
machine's other work only adds noise): ``connect_plan_s`` (wall time of plan, schedules, the
wiring's sender ranks and every init body), ``rank0_mem_mb`` (the process's peak RSS during it
over its RSS before), and ``max_init_body_kb`` (the largest server's init body as JSON, what
``init_group`` posts); ``build_plan_s`` and ``init_infos_s`` are two parts of the time. A size
that runs past :data:`LIMIT_S` or past :data:`MEMORY_LIMIT_MB` is stopped and its row says so
(``stopped``), and the larger sizes of its model and mode are not run.
"""

from __future__ import annotations

import json
import multiprocessing
import resource
import threading
import time

from benchmarks._harness import main_for

TITLE = "Weight-bridge connect planning at N servers x TP 4: rank-0 time, memory, largest init body"
SERVERS = (8, 64, 256)
SERVERS_QUICK = (8,)
SERVER_TP = 4
MODES = ("sharded", "broadcast")
BUCKET_MB = 1024
"""The GPU default (``weight_update.bucket_mb``)."""
LIMIT_S = 180.0
"""A size stops after this long (its row says so; the larger sizes of its model and mode are skipped)."""
MEMORY_LIMIT_MB = 12_000
"""A size stops when its process grows past this (the machine's memory is shared)."""

QWEN25_7B = {
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
MODELS = {
    "qwen2.5-7b": (QWEN25_7B, "megatron:d16p1t4"),  # configs/gsm8k_grpo_qwen2.5-7b_128gpu.yaml
    "qwen3-30b-a3b": (QWEN3_30B_A3B, "megatron:d16p2t4e8et1"),  # configs/gsm8k_grpo_qwen3-30b-a3b_256gpu.yaml
}


def hf_config(fields: dict):
    """The ``transformers`` config of ``fields`` (its ``model_type`` picks the class)."""
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def hf_shapes(desc, trainer) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor the family mapping names, from the config alone."""
    from megarl.bridge.transfer_plan import enumerate_sources

    cfg = desc.hf_config
    hidden, heads, kv = cfg.hidden_size, desc.dims.num_attention_heads, desc.dims.num_query_groups
    head_dim = desc.dims.head_dim
    ffn = cfg.intermediate_size
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    expert_ffn = getattr(cfg, "moe_intermediate_size", None) or ffn
    by_suffix = {
        "embed_tokens.weight": (cfg.vocab_size, hidden),
        "lm_head.weight": (cfg.vocab_size, hidden),
        "norm.weight": (hidden,),
        "layernorm.weight": (hidden,),
        "q_proj.weight": (heads * head_dim, hidden),
        "k_proj.weight": (kv * head_dim, hidden),
        "v_proj.weight": (kv * head_dim, hidden),
        "q_proj.bias": (heads * head_dim,),
        "k_proj.bias": (kv * head_dim,),
        "v_proj.bias": (kv * head_dim,),
        "o_proj.weight": (hidden, heads * head_dim),
        "q_norm.weight": (head_dim,),
        "k_norm.weight": (head_dim,),
        "mlp.gate.weight": (experts, hidden),
    }
    out = {}
    for src in enumerate_sources(desc.mapping, cfg, trainer):
        for name in src.hf_names:
            width = expert_ffn if ".experts." in name else ffn
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                out[name] = (width, hidden)
            elif name.endswith("down_proj.weight"):
                out[name] = (hidden, width)
            else:  # the longest suffix that fits (q_norm.weight before norm.weight)
                suffix = max((x for x in by_suffix if name.endswith(x)), key=len)
                out[name] = by_suffix[suffix]
    return out


class _Server:
    """What ``connect`` reads of a server: its address, TP size and kind."""

    name = "vllm"

    def __init__(self, index: int, tp: int):
        self.address, self.tp = f"10.0.{index // 250}.{index % 250 + 1}:8000", tp


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class _PeakRSS:
    """The process's peak RSS while in the block (sampled every 5 ms, and the kernel's high-water mark)."""

    def __enter__(self):
        self.before = self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def measure(model: str, mode: str, servers: int, tp: int = SERVER_TP) -> dict:
    """One row: rank 0's planning in ``WeightBridge.connect`` for ``servers`` servers of TP ``tp``."""
    import gc
    import logging

    import torch

    from megarl.bridge.blocks import regroup
    from megarl.bridge.bridge import WeightBridge
    from megarl.bridge.source import TrainerCoords
    from megarl.config.allocation import AllocationMode
    from megarl.config.bridge import WeightUpdateConfig
    from megarl.models.build import describe

    torch.set_num_threads(1)  # planning is serial; intra-op threads only add noise on a shared machine
    logging.getLogger("megarl").setLevel(logging.ERROR)
    fields, layout = MODELS[model]
    trainer = AllocationMode.from_str(layout).train
    desc = describe(hf_config(fields), trainer.tp)
    shapes = hf_shapes(desc, trainer)
    config = WeightUpdateConfig(mode=mode, dtype="bfloat16", bucket_mb=BUCKET_MB)
    bridge = WeightBridge(config, desc, shapes, trainer, TrainerCoords(0), device="cpu")
    bridge.servers = [_Server(i, tp) for i in range(servers)]
    modes = config.modes
    gc.collect()
    with _PeakRSS() as mem:
        start = time.perf_counter()
        # WeightBridge.connect, up to the init bodies (the servers cut into blocks, a plan and schedules
        # per distinct block, every block's wiring and every server's init body)
        blocks = [bridge._block(run, modes) for run in regroup([], bridge.servers, config.group_servers(servers))[1]]
        planned = time.perf_counter()
        for block in blocks:
            bsched, ssched = block.broadcast_schedule, block.sharded_schedule
            block.wiring = _wiring(
                block.plan, bsched.senders if "broadcast" in modes else [], ssched.senders if ssched else []
            )
        init = time.perf_counter()
        infos = {s.address: info for b in blocks for s, info in zip(b.servers, bridge._init_infos(b))}
        end = time.perf_counter()
    body_kb = max(len(json.dumps(info)) for info in infos.values()) / 1024
    return {
        **_empty_row(model, mode, servers, tp),
        "connect_plan_s": round(end - start, 3),
        "rank0_mem_mb": round(max(0.0, mem.peak - mem.before), 1),
        "max_init_body_kb": round(body_kb, 1),
        "build_plan_s": round(planned - start, 3),
        "init_infos_s": round(end - init, 3),
    }


def _wiring(plan, broadcast_owners, sharded_owners):
    """The groups as ``WeightBridge._wire`` forms them (ranks in Megatron's order, made-up addresses)."""
    from megarl.bridge.wiring import make_wiring
    from tests.bridge.workers import layout_coords

    coords = layout_coords(plan.trainer)
    rank_of = {o: next(c.rank for c in coords if c.holds(o)) for o in [*broadcast_owners, *sharded_owners]}
    return make_wiring(
        "nccl",
        len(plan.workers),
        broadcast_owners,
        sharded_owners,
        rank_of.__getitem__,
        lambda r, k: (f"10.1.{r // 250}.{r % 250 + 1}", 29500 + k),
        "megarl-bridge-123456789",
    )


def _child(conn, model: str, mode: str, servers: int, tp: int) -> None:
    try:
        conn.send(("ok", measure(model, mode, servers, tp)))
    except Exception as e:  # noqa: BLE001 (reported in the row)
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _in_own_process(model: str, mode: str, servers: int, tp: int = SERVER_TP) -> dict:
    """:func:`measure` in a fresh process, stopped past :data:`LIMIT_S` or :data:`MEMORY_LIMIT_MB`."""
    import psutil

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, model, mode, servers, tp), daemon=True)
    start = time.perf_counter()
    proc.start()
    child.close()
    stopped, peak = "", 0.0
    while not parent.poll(0.5):
        if not proc.is_alive():
            stopped = f"the process died (exit {proc.exitcode})"
            break
        try:
            peak = max(peak, psutil.Process(proc.pid).memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            continue
        if time.perf_counter() - start > LIMIT_S:
            stopped = f"stopped after {LIMIT_S:.0f} s"
        elif peak > MEMORY_LIMIT_MB:
            stopped = f"stopped at {peak / 1024:.1f} GiB RSS after {time.perf_counter() - start:.0f} s"
        if stopped:
            proc.kill()
            break
    result = None if stopped else parent.recv()
    proc.join(10)
    if result is None or result[0] != "ok":
        return {**_empty_row(model, mode, servers, tp), "stopped": stopped or result[1]}
    return result[1]


def _empty_row(model: str, mode: str, servers: int, tp: int = SERVER_TP) -> dict:
    return {
        "model": model,
        "mode": mode,
        "servers": servers,
        "tp": tp,
        "workers": servers * tp,
        "connect_plan_s": None,
        "rank0_mem_mb": None,
        "max_init_body_kb": None,
        "build_plan_s": None,
        "init_infos_s": None,
        "stopped": "",
    }


def run(quick: bool, on_rows=None) -> list[dict]:
    rows = []
    for model in MODELS:
        for mode in MODES:
            stopped = ""
            for servers in SERVERS_QUICK if quick else SERVERS:
                if stopped:  # a larger size of a stopped one: not run
                    rows.append({**_empty_row(model, mode, servers), "stopped": f"not run ({stopped})"})
                else:
                    rows.append(_in_own_process(model, mode, servers))
                    stopped = rows[-1]["stopped"] and f"{rows[-1]['workers']} workers stopped"
                print(json.dumps(rows[-1]), flush=True)
                if on_rows is not None:
                    on_rows(rows)
    return rows


def summary(rows: list[dict]) -> str:
    done = [r for r in rows if r["connect_plan_s"] is not None]
    if not done:
        return "No size finished."
    worst = max(done, key=lambda r: r["connect_plan_s"])
    return (
        f"Slowest: {worst['model']} {worst['mode']} at {worst['workers']} workers, {worst['connect_plan_s']} s; "
        f"largest init body {max(r['max_init_body_kb'] for r in done)} KB; "
        f"largest rank-0 growth {max(r['rank0_mem_mb'] or 0 for r in done)} MB."
    )


if __name__ == "__main__":
    main_for(__name__)
