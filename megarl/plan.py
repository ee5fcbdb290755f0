"""Allocation planner: predict an RL step's time from component rates, and rank device splits.

The model is deliberately small. An RL step has four phases (``megarl/train.py``):

* **rollout**: the servers generate ``prompts x samples x gen_tokens`` tokens. Time =
  tokens / (servers x one server's tokens/s at its TP); a synchronous step also waits for its
  longest sample (``max_new_tokens`` x the server's per-token latency), which an asynchronous
  pool keeps generating across steps;
* **train**: logprob recompute and PPO update over ``prompts x samples x (prompt + gen)``
  tokens. Time = tokens / (one data-parallel replica's tokens/s at its PP x TP shape x DP x
  ``dp_efficiency`` ** log2(DP));
* **sync**: the weight update, ``sync_fixed_s`` + ``model_bytes`` / ``sync_bytes_per_s``;
* **overhead**: what no phase timer holds (hand-off, advantages, logging), never overlapped.

With ``rollout.max_staleness = 0`` the phases take turns: step = rollout + train + sync +
overhead. With ``max_staleness >= 1`` the rollout of step k+1 runs while step k trains, but
the servers pause for the weight sync (interruptible generation), so in steady state
step = max(rollout, train) + (``overlap_slowdown`` - 1) x min(rollout, train) + sync + overhead,
where ``overlap_slowdown`` (1 on separate devices) is how much both slow down while they share
a machine. A larger bound absorbs variance between steps;
it does not change this steady state.

Rates come from a YAML or JSON file (:func:`load_rates`): measured on this machine by
``python -m benchmarks.plan --calibrate``, or assumed (the GPU rates in
``benchmarks/plan_rates_h100_qwen2.5-7b.yaml``: no GPU cluster has run megarl yet).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megarl.config.allocation import (
    AllocationError,
    AllocationMode,
    ModelShape,
    validate_allocation,
)
from megarl.models.peft_files import covered_modules


@dataclass(frozen=True)
class ServerRate:
    """One inference server at one tensor-parallel size."""

    tokens_per_s: float
    """Generated tokens per second of one server, at the workload's concurrency."""
    token_latency_s: float = 0.0
    """Seconds per decoded token of one request under that load: a synchronous rollout lasts at
    least ``max_new_tokens`` times this (its longest sample). 0: folded into ``tokens_per_s``."""


@dataclass(frozen=True)
class Workload:
    """The tokens of one RL step."""

    prompts: int
    """Prompts per step (``train_dataset.batch_size``)."""
    samples: int
    """Samples per prompt (``gconfig.n_samples``)."""
    prompt_tokens: float
    """Mean prompt length in tokens."""
    gen_tokens: float
    """Mean generated tokens per sample."""
    max_new_tokens: int = 0
    """``gconfig.max_new_tokens``: the longest a sample can decode (0: no latency bound)."""
    route_ids: int = 0
    """Expert ids the servers return per token (MoE, ``rollout.return_routed_experts``: layers x top-k)."""

    @property
    def generated(self) -> float:
        return self.prompts * self.samples * self.gen_tokens

    @property
    def route_bytes(self) -> float:
        """Bytes of the routed experts a rollout batch carries to the trainer (int16 per id, every token)."""
        return self.trained * self.route_ids * 2

    @property
    def trained(self) -> float:
        return self.prompts * self.samples * (self.prompt_tokens + self.gen_tokens)


@dataclass(frozen=True)
class Rates:
    """Measured or assumed component rates; every field is a key of the rates file."""

    source: str
    """Where the numbers come from ("measured: ..." or "assumed: ..."): printed with every plan."""
    server: dict[int, ServerRate]
    """By tensor-parallel size (file keys ``t1``, ``t2``, ...)."""
    trainer: dict[tuple[int, int], float]
    """Trained tokens/s (recompute + update) of ONE data-parallel replica, by (PP, TP) (file keys
    ``p1t1``, ``p2t4``, ...). Only these shapes are planned: list those that fit in memory."""
    dp_efficiency: float = 1.0
    """Throughput kept per doubling of data parallelism (gradient all-reduce, stragglers)."""
    sync_fixed_s: float = 0.0
    """Seconds of a weight update whatever its size (pause, commit, resume)."""
    sync_bytes_per_s: float = math.inf
    """Bandwidth of the weight transfer."""
    model_bytes: float = 0.0
    """Bytes sent per weight update (parameters x bytes per parameter)."""
    sync_what: str = "the model"
    """What a weight update sends (printed with the plan): the model, or LoRA adapters (:func:`for_config`)."""
    overhead_s: float = 0.0
    """Seconds per step outside the phases, never overlapped."""
    overlap_slowdown: float = 1.0
    """How much slower rollout and training run while they overlap: 1 on separate GPUs; above 1
    when they share a machine's cores, caches or memory bandwidth (measured on CPU by
    ``benchmarks/plan.py --calibrate``)."""
    workload: Workload | None = None
    """The step's tokens when the file has them (a calibration does); else from the config."""
    model: ModelShape | None = None
    """Heads and layers to check TP and PP against when the model directory is not at hand."""


@dataclass(frozen=True)
class Prediction:
    """The predicted phases of one allocation, in seconds."""

    allocation: str
    rollout_s: float
    train_s: float
    sync_s: float
    overhead_s: float
    step_s: float
    overlap_s: float
    """Rollout seconds hidden behind training (0 when synchronous)."""

    @property
    def overlap_pct(self) -> float:
        """Share of the rollout hidden behind training."""
        return 100 * self.overlap_s / self.rollout_s if self.rollout_s else 0.0

    @property
    def bottleneck(self) -> str:
        return "rollout" if self.rollout_s > self.train_s else "train"


def rollout_seconds(rates: Rates, work: Workload, alloc: AllocationMode, synchronous: bool = True) -> float:
    """Generation time of one step's samples on the allocation's servers (``synchronous``: until
    the longest sample ends)."""
    inf = alloc.inference
    if inf is None:
        raise AllocationError(f"allocation_mode '{alloc}' has no inference part to plan a rollout on")
    rate = rates.server.get(inf.tp)
    if rate is None:
        raise AllocationError(
            f"no server rate for TP {inf.tp} (allocation_mode '{alloc}'); the rates have TP "
            f"{', '.join(map(str, sorted(rates.server)))} ({rates.source})"
        )
    longest = work.max_new_tokens * rate.token_latency_s if synchronous else 0.0
    return max(work.generated / (inf.dp * rate.tokens_per_s), longest)


def train_seconds(rates: Rates, work: Workload, alloc: AllocationMode) -> float:
    """Recompute + update time of one step's tokens on the allocation's trainer."""
    train = alloc.train
    if train is None:
        raise AllocationError(f"allocation_mode '{alloc}' has no training part to plan")
    if train.cp > 1:
        raise AllocationError(
            f"no trainer rate for context parallel c{train.cp} (allocation_mode '{alloc}'): the rates are "
            "measured per PP x TP without it; plan the layout with those devices in d, t or p"
        )
    rate = rates.trainer.get((train.pp, train.tp))
    if rate is None:
        shapes = ", ".join(f"p{p}t{t}" for p, t in sorted(rates.trainer))
        raise AllocationError(
            f"no trainer rate for PP {train.pp} x TP {train.tp} (allocation_mode '{alloc}'); "
            f"the rates have {shapes} ({rates.source})"
        )
    replicas = train.dp * rates.dp_efficiency ** math.log2(train.dp)
    return work.trained / (rate * replicas)


def sync_seconds(rates: Rates) -> float:
    """One weight update."""
    return rates.sync_fixed_s + rates.model_bytes / rates.sync_bytes_per_s


def predict(rates: Rates, work: Workload, alloc: AllocationMode, max_staleness: int) -> Prediction:
    """The step time of ``alloc`` and how much of the rollout hides behind training."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    # colocated parts (``|``) take turns on their devices: nothing overlaps, whatever the staleness bound
    turns = max_staleness == 0 or alloc.colocated
    rollout = rollout_seconds(rates, work, alloc, synchronous=turns)
    train = train_seconds(rates, work, alloc)
    sync = sync_seconds(rates)
    if turns:
        step, overlap = rollout + train + sync + rates.overhead_s, 0.0
    else:
        # both run slowed while they overlap (the shorter phase's length), then the longer alone
        shorter = min(rollout, train)
        step = max(rollout, train) + (rates.overlap_slowdown - 1) * shorter + sync + rates.overhead_s
        overlap = shorter
    return Prediction(str(alloc), rollout, train, sync, rates.overhead_s, step, overlap)


def candidate_splits(rates: Rates, n_devices: int, backend: str = "vllm") -> list[AllocationMode]:
    """Every ``backend:dXtT+megatron:dYpPtT`` on ``n_devices`` whose TP and PP x TP have rates."""
    splits = []
    for tp in sorted(rates.server):
        for n_inf in range(tp, n_devices, tp):
            for pp, ttp in sorted(rates.trainer):
                n_train = n_devices - n_inf
                if n_train % (pp * ttp) == 0:
                    spec = f"{backend}:d{n_inf // tp}t{tp}+megatron:d{n_train // (pp * ttp)}p{pp}t{ttp}"
                    splits.append(AllocationMode.from_str(spec))
    return splits


@dataclass(frozen=True)
class Plan:
    """Ranked predictions (fastest step first) and the splits refused, with why."""

    ranked: list[Prediction]
    refused: list[tuple[str, str]] = field(default_factory=list)


def rank_splits(
    rates: Rates,
    work: Workload,
    n_devices: int,
    max_staleness: int,
    *,
    gpus_per_node: int | None = None,
    model: ModelShape | None = None,
    batch: tuple[int, int] | None = None,
    backend: str = "vllm",
) -> Plan:
    """Rank the splits of ``n_devices`` by predicted step time.

    A split is refused when :func:`validate_allocation` refuses it against the cluster
    (``gpus_per_node``: whole nodes per part) or the model, or when ``batch``
    (``train_dataset.batch_size``, ``actor.ppo_n_minibatches``) does not split over its trainer DP.
    """
    if n_devices < 2:
        raise ValueError(f"n_devices must be >= 2 (one for a server, one for the trainer), got {n_devices}")
    nodes = n_devices // gpus_per_node if gpus_per_node else None
    if gpus_per_node and n_devices % gpus_per_node:
        raise ValueError(f"{n_devices} devices are not whole nodes of {gpus_per_node} GPUs")
    ranked, refused = [], []
    for alloc in candidate_splits(rates, n_devices, backend):
        try:
            validate_allocation(alloc, n_nodes=nodes, n_gpus_per_node=gpus_per_node, model=model or rates.model)
            if batch is not None and batch[0] % (alloc.train.dp * batch[1]):
                raise AllocationError(
                    f"train_dataset.batch_size {batch[0]} is not divisible by trainer DP "
                    f"{alloc.train.dp} x actor.ppo_n_minibatches {batch[1]}"
                )
        except AllocationError as err:
            refused.append((str(alloc), str(err)))
            continue
        ranked.append(predict(rates, work, alloc, max_staleness))
    if not ranked:
        raise ValueError(
            f"no split of {n_devices} devices fits the rates' TP {sorted(rates.server)} and trainer "
            f"shapes {sorted(rates.trainer)}; first refusal: {refused[0][1] if refused else 'none'}"
        )
    # equal steps: the shorter rollout first, it has more room for long samples
    return Plan(sorted(ranked, key=lambda p: (round(p.step_s, 6), p.rollout_s, p.allocation)), refused)


def workload_of(
    rates: Rates, config=None, prompt_tokens: float | None = None, gen_tokens: float | None = None
) -> Workload:
    """The step's tokens: counts from the experiment ``config`` (else the rates file's
    ``workload``), mean lengths from the arguments, else the rates file's ``workload``."""
    base = rates.workload
    if (prompt_tokens is None or gen_tokens is None) and base is None:
        raise ValueError(
            f"the rates ({rates.source}) have no 'workload' section: give --prompt-tokens and --gen-tokens"
        )
    prompt_tokens = base.prompt_tokens if prompt_tokens is None else prompt_tokens
    gen_tokens = base.gen_tokens if gen_tokens is None else gen_tokens
    if config is None:
        if base is None:
            raise ValueError("without --config the rates file must have a 'workload' section (prompts, samples)")
        return dataclasses.replace(base, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens)
    g = config.gconfig
    return Workload(
        config.train_dataset.batch_size,
        g.n_samples,
        prompt_tokens,
        min(gen_tokens, g.max_new_tokens),
        g.max_new_tokens,
        route_ids=_route_ids(config) if config.rollout.return_routed_experts else 0,
    )


def _route_ids(config) -> int:
    """Layers x top-k of the actor's MoE model (0 where its ``config.json`` is not at hand or it has no experts)."""
    hf = _actor_hf_config(config) or {}
    return hf.get("num_hidden_layers", 0) * (hf.get("num_experts_per_tok") or 0)


def _actor_hf_config(config) -> dict | None:
    """The ``config.json`` of ``actor.path`` (a short name: its directory, made locally on first use), or None."""
    from megarl.models.names import known_name
    from megarl.models.provision import resolve_model_path
    from megarl.run.prelaunch import read_model_config

    path = config.actor.path
    if known_name(path) is not None:
        path = resolve_model_path(path)
    return read_model_config(path, "actor.path")


def for_config(rates: Rates, config) -> Rates:
    """``rates`` as an experiment ``config`` changes them: with LoRA adapter sync (``weight_update.lora:
    adapter``) an update sends the adapters, not the model (:func:`lora_numel`, in the wire dtype)."""
    if config is None or not config.adapter_sync:
        return rates
    hf = _actor_hf_config(config)
    if hf is None:
        raise ValueError(
            f"megarl plan: weight_update.lora=adapter sizes the update from the model's config.json, and "
            f"actor.path={config.actor.path!r} has none here"
        )
    lora = config.actor.lora
    itemsize = 4 if config.weight_update.dtype == "float32" else 2
    numel = lora_numel(hf, lora.rank, lora.target_modules)
    return dataclasses.replace(
        rates,
        model_bytes=numel * itemsize,
        sync_what=f"LoRA adapters of rank {lora.rank}, {numel * itemsize / 1e6:,.1f} MB",
    )


_HF_MODULE_SIZES = {  # HF module -> (input size, output size)
    "q_proj": ("hidden", "q_out"),
    "k_proj": ("hidden", "kv_out"),
    "v_proj": ("hidden", "kv_out"),
    "o_proj": ("q_out", "hidden"),
    "gate_proj": ("hidden", "inter"),
    "up_proj": ("hidden", "inter"),
    "down_proj": ("inter", "hidden"),
}


def lora_numel(hf_config: dict, rank: int, target_modules) -> int:
    """Numbers in a PEFT adapter of ``rank`` on the dense ``target_modules`` of a model (what adapter sync
    sends per update): ``rank x (in + out)`` per HF module per layer, whether the modules of a fused linear
    share one ``A`` (its Megatron name) or have their own (HF names); expert targets are not counted."""
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    sizes = {
        "hidden": hidden,
        "q_out": heads * head_dim,
        "kv_out": (hf_config.get("num_key_value_heads") or heads) * head_dim,
        "inter": hf_config.get("intermediate_size", 0),
    }
    modules = covered_modules(target_modules)
    per_layer = sum(
        rank * (sizes[n_in] + sizes[n_out]) for m, (n_in, n_out) in _HF_MODULE_SIZES.items() if m in modules
    )
    return per_layer * hf_config["num_hidden_layers"]


def plan_for_config(rates: Rates, work: Workload, config, max_staleness: int, n_devices: int | None = None) -> Plan:
    """:func:`rank_splits` for an experiment: its cluster (or ``n_devices``), model, batch and backend."""
    from megarl.run.prelaunch import read_model_shape

    cluster = config.cluster
    n_devices = n_devices or cluster.n_nodes * cluster.n_gpus_per_node
    multi_node = n_devices > cluster.n_gpus_per_node
    model = read_model_shape(config.actor.path)  # None when the directory is not on this machine: the rates' model
    backend = config.allocation.inference.backend if config.allocation.inference else "vllm"
    return rank_splits(
        rates,
        work,
        n_devices,
        max_staleness,
        gpus_per_node=cluster.n_gpus_per_node if multi_node else None,
        model=model,
        batch=(config.train_dataset.batch_size, config.actor.ppo_n_minibatches),
        backend=backend,
    )


def prediction_row(p: Prediction) -> dict[str, str]:
    """One line of the plan's table."""
    return {
        "allocation_mode": p.allocation,
        "rollout s": f"{p.rollout_s:.1f}",
        "train s": f"{p.train_s:.1f}",
        "sync s": f"{p.sync_s:.1f}",
        "step s": f"{p.step_s:.1f}",
        "rollout hidden": f"{p.overlap_pct:.0f}%",
        "bound by": p.bottleneck,
    }


def assumptions(rates: Rates, work: Workload, max_staleness: int) -> list[str]:
    """What a plan assumed, one line each: printed above its table."""
    servers = ", ".join(
        f"TP {tp}: {r.tokens_per_s:,.0f} tok/s"
        + (f", {r.token_latency_s * 1e3:.0f} ms/token" if r.token_latency_s else "")
        for tp, r in sorted(rates.server.items())
    )
    trainers = ", ".join(f"p{p}t{t}: {v:,.0f} tok/s" for (p, t), v in sorted(rates.trainer.items()))
    mode = (
        "synchronous (rollout, then train)" if max_staleness == 0 else f"asynchronous (max_staleness {max_staleness})"
    )
    return [
        f"rates: {rates.source}",
        f"one server: {servers}",
        f"one trainer replica (recompute + update): {trainers}; DP efficiency {rates.dp_efficiency:g} per doubling",
        (
            f"weight sync ({rates.sync_what}): {sync_seconds(rates):.2f} s; other per-step overhead "
            f"{rates.overhead_s:.2f} s; "
            f"rollout and training {rates.overlap_slowdown:.2f}x slower while they overlap"
        ),
        (
            f"step: {work.prompts} prompts x {work.samples} samples, {work.prompt_tokens:.0f} prompt + "
            f"{work.gen_tokens:.0f} generated tokens each (max {work.max_new_tokens}); {mode}"
        ),
    ] + (
        [f"routed experts: {work.route_ids} int16 ids per token, {work.route_bytes / 1e6:,.1f} MB per rollout batch"]
        if work.route_ids
        else []
    )


# ------------------------------------------------------------------------------------ rates file


class RatesFileError(ValueError):
    """A rates file that cannot be read; the message names the file and the key."""


def load_rates(path: str | Path) -> Rates:
    """Read a rates file (YAML or JSON); see ``docs/guides/plan.md`` for its keys."""
    path = Path(path)
    if not path.is_file():
        raise RatesFileError(f"rates file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RatesFileError(f"rates file {path} is not YAML or JSON: {err}") from None
    if not isinstance(raw, dict):
        raise RatesFileError(f"rates file {path}: expected a mapping of keys, got {type(raw).__name__}")
    return rates_from_dict(raw, str(path))


def rates_from_dict(raw: dict, where: str = "rates") -> Rates:
    """Build :class:`Rates` from a rates file's mapping; errors name ``where`` and the key."""

    def number(value, key: str, positive: bool = True) -> float:
        if isinstance(value, str):  # YAML 1.1 reads 5.0e9 (no sign after e) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not value > 0) or value < 0:
            need = "a number > 0" if positive else "a number >= 0"
            raise RatesFileError(f"rates file {where}: key '{key}' must be {need}, got {value!r}")
        return float(value)

    def section(key: str) -> dict:
        value = raw.get(key)
        if not isinstance(value, dict) or not value:
            raise RatesFileError(f"rates file {where}: key '{key}' must be a non-empty mapping, got {value!r}")
        return value

    if not isinstance(raw.get("source"), str):
        raise RatesFileError(
            f"rates file {where}: key 'source' must say where the rates come from (measured or assumed)"
        )
    server = {}
    for name, entry in section("server").items():
        tp = _shape(name, ("t",), where, "server")[0]
        entry = entry if isinstance(entry, dict) else {"tokens_per_s": entry}
        server[tp] = ServerRate(
            number(entry.get("tokens_per_s"), f"server.{name}.tokens_per_s"),
            number(entry.get("token_latency_s", 0.0), f"server.{name}.token_latency_s", False),
        )
    trainer = {
        _shape(name, ("p", "t"), where, "trainer"): number(value, f"trainer.{name}")
        for name, value in section("trainer").items()
    }
    sync = raw.get("sync", {}) or {}
    efficiency = number(raw.get("dp_efficiency", 1.0), "dp_efficiency")
    if efficiency > 1:
        raise RatesFileError(f"rates file {where}: key 'dp_efficiency' must be <= 1, got {efficiency}")
    return Rates(
        source=raw["source"],
        server=server,
        trainer=trainer,
        dp_efficiency=efficiency,
        sync_fixed_s=number(sync.get("fixed_s", 0.0), "sync.fixed_s", False),
        sync_bytes_per_s=number(sync.get("bytes_per_s", math.inf), "sync.bytes_per_s"),
        model_bytes=number(sync.get("model_bytes", 0.0), "sync.model_bytes", False),
        overhead_s=number(raw.get("overhead_s", 0.0), "overhead_s", False),
        overlap_slowdown=_at_least_one(number(raw.get("overlap_slowdown", 1.0), "overlap_slowdown"), where),
        workload=_workload(raw["workload"], where, number) if raw.get("workload") else None,
        model=ModelShape(**raw["model"]) if raw.get("model") else None,
    )


def _at_least_one(value: float, where: str) -> float:
    if value < 1:
        raise RatesFileError(f"rates file {where}: key 'overlap_slowdown' must be >= 1, got {value}")
    return value


def _shape(name, letters: tuple[str, ...], where: str, key: str) -> tuple[int, ...]:
    """``t2`` -> (2,), ``p2t4`` -> (2, 4)."""
    match = re.fullmatch("".join(f"{letter}([1-9][0-9]*)" for letter in letters), str(name))
    if match is None:
        example = "".join(f"{letter}2" for letter in letters)
        raise RatesFileError(f"rates file {where}: key '{key}.{name}' is not a layout like '{example}'")
    return tuple(int(g) for g in match.groups())


def _workload(raw: dict, where: str, number) -> Workload:
    keys = {f.name for f in dataclasses.fields(Workload)}
    unknown = set(raw) - keys
    if unknown:
        raise RatesFileError(f"rates file {where}: unknown key 'workload.{min(unknown)}'; known: {sorted(keys)}")
    return Workload(
        prompts=int(number(raw.get("prompts"), "workload.prompts")),
        samples=int(number(raw.get("samples"), "workload.samples")),
        prompt_tokens=number(raw.get("prompt_tokens"), "workload.prompt_tokens", False),
        gen_tokens=number(raw.get("gen_tokens"), "workload.gen_tokens"),
        max_new_tokens=int(number(raw.get("max_new_tokens", 0), "workload.max_new_tokens", False)),
    )


def rates_to_dict(rates: Rates) -> dict:
    """The rates file's mapping of ``rates`` (what ``--calibrate`` writes)."""
    out = {
        "source": rates.source,
        "server": {f"t{tp}": dataclasses.asdict(r) for tp, r in sorted(rates.server.items())},
        "trainer": {f"p{p}t{t}": v for (p, t), v in sorted(rates.trainer.items())},
        "dp_efficiency": rates.dp_efficiency,
        "sync": {"fixed_s": rates.sync_fixed_s, "model_bytes": rates.model_bytes},
        "overhead_s": rates.overhead_s,
        "overlap_slowdown": rates.overlap_slowdown,
    }
    if math.isfinite(rates.sync_bytes_per_s):
        out["sync"]["bytes_per_s"] = rates.sync_bytes_per_s
    if rates.workload is not None:
        out["workload"] = dataclasses.asdict(rates.workload)
    if rates.model is not None:
        out["model"] = dataclasses.asdict(rates.model)
    return json.loads(json.dumps(out))
