"""The ``megarl`` command line. Every user-facing print of the package goes through here.

megarl config --config configs/gsm8k_grpo_cpu.yaml actor.optimizer.lr=2e-6
megarl allocation vllm:d4t2+megatron:d2p2t2e2 --nodes 3 --gpus-per-node 8
megarl models fetch smollm2-135m-instruct
megarl slurm --dry-run --config configs/gsm8k_grpo_qwen2.5-7b_128gpu.yaml
megarl run configs/gsm8k_grpo_cpu.yaml actor.optimizer.lr=1e-5
megarl plan --rates benchmarks/plan_rates_h100_qwen2.5-7b.yaml --config configs/gsm8k_grpo_qwen2.5-7b_128gpu.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from rich.console import Console
from rich.table import Table

from megarl.config import (
    AllocationError,
    AllocationMode,
    ConfigError,
    GRPOConfig,
    ModelShape,
    save_config,
    to_yaml,
    validate_allocation,
)
from megarl.run.prelaunch import load_expr_config, read_model_shape


def _cmd_config(args: argparse.Namespace, console: Console) -> int:
    config = _load(args)
    console.print(to_yaml(config), end="", markup=False, highlight=False)
    if args.save:
        console.print(f"# written to {save_config(config)}", markup=False)
    return 0


def _cmd_allocation(args: argparse.Namespace, console: Console) -> int:
    if (args.nodes is None) != (args.gpus_per_node is None):
        raise ValueError("--nodes and --gpus-per-node go together: give both to check the device count, or neither")
    alloc = AllocationMode.from_str(args.mode)
    model = None
    if args.model:
        model = read_model_shape(args.model)
        if model is None:
            raise AllocationError(f"--model {args.model!r} is not a directory with a config.json")
    validate_allocation(alloc, n_nodes=args.nodes, n_gpus_per_node=args.gpus_per_node, model=model)
    console.print(_allocation_table(alloc, model))
    return 0


def _allocation_table(alloc: AllocationMode, model: ModelShape | None) -> Table:
    table = Table(title=f"allocation_mode {alloc}" + (" (checked against the model)" if model else ""))
    for column in ("part", "backend", "layout", "devices"):
        table.add_column(column)
    if alloc.inference:
        inf = alloc.inference
        layout = f"{inf.dp} servers x TP {inf.tp} x PP {inf.pp}"
        table.add_row("inference", inf.backend, layout, str(inf.world_size))
    if alloc.train:
        t = alloc.train
        layout = (
            f"DP {t.dp} x PP {t.pp} x TP {t.tp} x CP {t.cp}; VPP {t.vpp}; EP {t.ep} x ETP {t.expert_tp} (EDP {t.edp})"
        )
        table.add_row("training", t.backend, layout, str(t.world_size))
    table.add_row("total", "", "", str(alloc.world_size))
    return table


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from megarl import plan

    config = _load(args) if args.config else None
    rates = plan.for_config(plan.load_rates(args.rates), config)
    work = plan.workload_of(rates, config, args.prompt_tokens, args.gen_tokens)
    staleness = args.max_staleness if args.max_staleness is not None else config.rollout.max_staleness if config else 1
    if args.mode:
        alloc = AllocationMode.from_str(args.mode)
        validate_allocation(alloc, model=(read_model_shape(config.actor.path) if config else None) or rates.model)
        predictions = [plan.predict(rates, work, alloc, staleness)]
    elif config is not None or args.devices:
        ranked = (
            plan.plan_for_config(rates, work, config, staleness, args.devices)
            if config
            else plan.rank_splits(rates, work, args.devices, staleness, model=rates.model)
        )
        predictions = ranked.ranked[: args.top]
        console.print(
            f"{len(ranked.ranked)} splits ranked, {len(ranked.refused)} refused "
            f"({ranked.refused[0][1] if ranked.refused else 'none'}{', ...' if len(ranked.refused) > 1 else ''})",
            markup=False,
            highlight=False,
        )
    else:
        raise ValueError("megarl plan needs --mode ALLOCATION, --devices N or --config FILE (its cluster size)")
    for line in plan.assumptions(rates, work, staleness):
        console.print(line, markup=False, highlight=False)
    rows = [{"rank": str(rank), **plan.prediction_row(p)} for rank, p in enumerate(predictions, 1)]
    # a Markdown table: wide allocation strings stay whole, and it pastes into a report
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row.values()) + " |" for row in rows]
    console.print("\n".join(["", *lines]), markup=False, highlight=False, soft_wrap=True)
    return 0


def _cmd_models(args: argparse.Namespace, console: Console) -> int:
    from megarl import models

    if args.action == "list":
        for name, description in models.KNOWN_MODELS.items():
            console.print(f"{name}: {description}", markup=False)
        return 0
    console.print(models.resolve_model_path(args.name, cache_dir=args.cache_dir), markup=False)
    return 0


def _load(args: argparse.Namespace) -> GRPOConfig:
    # `megarl run EXPERIMENT.yaml [PRESET.yaml ...] key=value`: leading YAML files are configs, in order
    files = []
    while args.overrides and args.overrides[0].endswith((".yaml", ".yml")) and "=" not in args.overrides[0]:
        files.append(args.overrides.pop(0))
    argv = [a for path in files + args.config for a in ("--config", path)] + args.overrides
    config, rest = load_expr_config(argv, GRPOConfig)
    if rest:
        raise ConfigError("", f"unexpected arguments {rest}; overrides are key.path=value")
    return config


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from megarl.launcher.serve import joined_index, serve, server_host
    from megarl.utils.network import find_free_ports

    devices = args.devices
    addr_file = Path(args.addr_file) if args.addr_file else None
    if args.join is None:
        if args.port is None:
            raise ConfigError("", "megarl serve: --port is required (it is optional only with --join)")
        config = _load(args)
        _serve_key(config, args, console)
        return serve(config, args.index, devices, args.port, addr_file, insecure=args.insecure)
    config = _join_config(Path(args.join), args)
    _serve_key(config, args, console)
    port = args.port if args.port is not None else find_free_ports(1, host=server_host(config))[0]
    return serve(
        config,
        joined_index(config),
        devices or list(range(config.allocation.inference.devices_per_server)),
        port,
        addr_file,
        join=True,
        drain_timeout=args.drain_timeout,
        insecure=args.insecure,
    )


def _serve_key(config: GRPOConfig, args: argparse.Namespace, console: Console) -> None:
    """The key ``megarl serve`` guards its server with: ``$MEGARL_API_KEY``, else ``{run_dir}/api_key``
    (made when missing; a joining server takes the run's); none with ``--insecure``."""
    from megarl.utils.auth import API_KEY_ENV, KEY_FILE, api_key, server_key

    if args.insecure:
        if api_key():
            raise ValueError(f"megarl serve --insecure: ${API_KEY_ENV} is set; unset it or drop --insecure")
        return
    if args.join is not None:
        if not api_key():
            raise ValueError(
                f"megarl serve --join {args.join}: the run has no {KEY_FILE} file; set ${API_KEY_ENV} to the "
                "key its servers run with, or pass --insecure if they run without one"
            )
        return
    path = server_key(config.run_dir)
    where = f"in {path.resolve()}" if path else f"from ${API_KEY_ENV}"
    console.print(
        f"megarl serve: API key {where}; clients send 'Authorization: Bearer <key>' "
        f"(the trainer: ${API_KEY_ENV}, or {{run_dir}}/{KEY_FILE} when it is unset)",
        markup=False,
        highlight=False,
    )


def _join_config(run_dir: Path, args: argparse.Namespace) -> GRPOConfig:
    """The saved config of the run at ``run_dir`` (its key too), then ``--config`` files and overrides."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(
            "",
            f"megarl serve --join {run_dir}: no {saved} (is it the run directory of a started run, "
            "{cluster.fileroot}/{experiment_name}/{trial_name}?)",
        )
    from megarl.utils.auth import load_run_key

    load_run_key(run_dir)
    args.config = [str(saved), *args.config]
    config = _load(args)
    if config.run_dir.resolve() != run_dir.resolve():
        raise ConfigError(
            "cluster.fileroot",
            f"megarl serve --join {run_dir}: the config names run directory "
            f"{config.run_dir}; join from the machine and path the run writes to",
        )
    return config


def _cmd_slurm(args: argparse.Namespace, console: Console) -> int:
    from megarl.launcher.slurm import render_convert_sbatch, render_sbatch, submit

    if args.convert_point:
        from megarl.run.convert_point import saved_world_size

        config, point = _point_to_convert(args, console)
        if point is None:
            return 0
        config_file = (config.run_dir / CONVERT_CONFIG).resolve()
        script = render_convert_sbatch(config, config_file, saved_world_size(point))
    else:
        config = _load(args)
        config_file = (config.run_dir / "config.yaml").resolve()
        script = render_sbatch(config, config_file, requeue=args.requeue)
    if args.dry_run:
        console.print(script, end="", markup=False, highlight=False)
        return 0
    # held while it writes; the job holds it from its start (the script's lock lines), so it is released
    # before the job is submitted: a job starting at once would find it held
    with nullcontext() if args.convert_point else _run_dir_held(config, console):
        save_config(config, config_file)
        (config.run_dir / "slurm").mkdir(parents=True, exist_ok=True)  # sbatch --output does not create it
        path = (
            Path(args.output)
            if args.output
            else config.run_dir / ("convert.sbatch" if args.convert_point else "job.sbatch")
        )
    job = submit(script, path)
    console.print(f"submitted job {job}: {path} (config {config_file})", markup=False)
    return 0


def _cmd_watchdog(args: argparse.Namespace, console: Console) -> int:
    from megarl.launcher.watchdog import job_servers, watch_job
    from megarl.serving import make_backend
    from megarl.serving.launch import env_server_addrs

    config = _load(args)
    addrs, _ = env_server_addrs(config.rollout)
    inference = config.allocation.inference
    endpoint = make_backend(inference.backend).health_endpoint if inference else "/health"
    return watch_job(config, args.trainer_pid, job_servers(addrs, endpoint))


def _cmd_report(args: argparse.Namespace, console: Console) -> int:
    from megarl.run.report import build_report

    if not Path(args.run_dir).is_dir():
        raise FileNotFoundError(
            f"{args.run_dir} is not a directory: pass a run directory, "
            "{cluster.fileroot}/{experiment_name}/{trial_name}"
        )
    console.print(f"wrote {build_report(args.run_dir)}", markup=False, highlight=False)
    return 0


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    config = _load(args)  # every config error before any process starts

    from megarl.launcher.local import check_local, server_specs, startup_lines

    plan = check_local(config)  # placement errors too before anything is written
    if args.check:
        server_specs(config, plan)  # each server's command line builds
        for line in startup_lines(config, plan):
            console.print(f"megarl: {line}", markup=False, highlight=False)
        console.print("megarl run --check: the config checks out; nothing was started", markup=False)
        return 0
    with _run_dir_held(config, console):  # for the run's whole life: a second start on it is refused
        return _run_here(config)


def _run_here(config: GRPOConfig) -> int:
    from megarl.launcher.local import run_local
    from megarl.serving.launch import ServerLaunchError
    from megarl.utils.logging import close_log_file, setup_logging

    log_file = config.run_dir / "logs" / "launcher.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    setup_logging("INFO", log_file=str(log_file), console_level="INFO" if config.launcher.verbose else "WARNING")
    err = Console(stderr=True, soft_wrap=True)
    try:
        return run_local(config, out=sys.stdout)
    except ServerLaunchError as e:
        err.print(f"megarl run: error: {e}", markup=False, highlight=False)
        return 1
    except KeyboardInterrupt:
        err.print("megarl run: interrupted; every server and trainer process was stopped", markup=False)
        return 130
    finally:
        close_log_file()


@contextmanager
def _run_dir_held(config: GRPOConfig, console: Console) -> Iterator[None]:
    """The run directory held by this command (an earlier run in it moved aside first, said on the
    console); one that a run still going holds is refused (exit 2) before anything in it is touched."""
    from megarl.run.earlier_run import claim_run_dir

    lock, moved = claim_run_dir(config)
    try:
        if moved:
            console.print(f"megarl: {moved}", markup=False, highlight=False)
        yield
    finally:
        if lock is not None:
            lock.release()


CONVERT_CONFIG = "convert_point.yaml"
"""The config a recover point's conversion reads, in the run directory (``convert-point``, ``slurm --convert-point``)."""


def _point_to_convert(args: argparse.Namespace, console: Console) -> tuple[GRPOConfig, Path | None]:
    """The run's config and its newest recover point; None for a point that loads at any layout already
    (said on the console: nothing to convert)."""
    from megarl.run.convert_point import needs_conversion, point_to_convert

    args.overrides.append("recover.mode=disabled")  # the config check would refuse the very point this converts
    config = _load(args)
    point = point_to_convert(config)
    if needs_conversion(point):
        return config, point
    console.print(
        f"megarl convert-point: {point} already loads at any layout (no optimizer state as per-rank shards)",
        markup=False,
        highlight=False,
    )
    return config, None


def _cmd_convert_point(args: argparse.Namespace, console: Console) -> int:
    import subprocess

    from megarl.launcher.local import torchrun_command
    from megarl.run.convert_point import saved_world_size
    from megarl.run.earlier_run import lock_run_dir

    config, point = _point_to_convert(args, console)
    if point is None:
        return 0
    ranks = saved_world_size(point)
    _require_devices(config, point, ranks)
    lock = lock_run_dir(config.run_dir)  # not while the run writes its points (refused, naming the run)
    try:
        config_file = save_config(config, config.run_dir / CONVERT_CONFIG).resolve()
        console.print(f"megarl convert-point: rewriting {point} on {ranks} ranks", markup=False, highlight=False)
        command = torchrun_command(config, ranks, ["-m", "megarl.run.convert_point", "--config", str(config_file)])
        converted = subprocess.run(command, check=False).returncode == 0
    finally:
        if lock is not None:
            lock.release()
    if not converted:
        console.print(f"megarl convert-point: failed; {point} is as it was", markup=False, highlight=False)
        return 1
    console.print(
        f"megarl convert-point: {point} now loads at any layout (optimizer.checkpoint_layout=any); resume it with "
        f"recover.mode=resume and the new allocation_mode (set actor.optimizer.checkpoint_layout=any to keep "
        f"writing it so)",
        markup=False,
        highlight=False,
    )
    return 0


def _require_devices(config: GRPOConfig, point: Path, ranks: int) -> None:
    """On GPUs, a GPU for each of the ``ranks`` that wrote ``point`` on this machine."""
    if config.device != "cuda":
        return
    import torch

    if torch.cuda.device_count() < ranks:
        raise ConfigError(
            "allocation_mode",
            f"recover point {point} was written by {ranks} ranks and this machine has {torch.cuda.device_count()} "
            f"GPUs: submit the conversion with `megarl slurm --convert-point`, or run `python -m "
            f"megarl.run.convert_point --config FILE` on {ranks} ranks under your cluster's launcher",
        )


def _positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return value


def _device_ids(text: str) -> list[int]:
    """An argparse type: comma-separated device ids (``0,1``); ``""`` for none."""
    ids = [part.strip() for part in text.split(",")] if text else []
    if not all(part.isdecimal() for part in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated device ids, e.g. 0,1")
    return [int(part) for part in ids]


CONFIG_ARGS_HELP = "CONFIG.yaml files (an experiment, then e.g. a parallel preset), then key.path=value overrides"


def _add_config_args(parser: argparse.ArgumentParser, overrides_help: str = "key.path=value overrides") -> None:
    parser.add_argument("--config", action="append", default=[], help="YAML file (repeatable; later files win)")
    parser.add_argument("overrides", nargs="*", help=overrides_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="Asynchronous RL for LLMs on Megatron-Core.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = sub.add_parser("config", help="load, validate and print an experiment config")
    config.add_argument("--save", action="store_true", help="also write it to {fileroot}/{experiment}/{trial}")
    _add_config_args(config, CONFIG_ARGS_HELP)
    config.set_defaults(func=_cmd_config)

    alloc = sub.add_parser("allocation", help="parse and check an allocation_mode string")
    alloc.add_argument("mode", help="e.g. vllm:d4t2+megatron:d2p2t2e2")
    alloc.add_argument(
        "--nodes", type=_positive_int, help="cluster nodes (with --gpus-per-node: check the device count)"
    )
    alloc.add_argument("--gpus-per-node", type=_positive_int, help="devices per node")
    alloc.add_argument("--model", help="HF model directory: check heads, layers and experts split evenly")
    alloc.set_defaults(func=_cmd_allocation)

    serve = sub.add_parser("serve", help="start one inference server of an experiment (used by the launchers)")
    serve.add_argument("--index", type=int, default=0, help="which server of the allocation's inference part")
    serve.add_argument(
        "--devices", type=_device_ids, default="", help="comma-separated device ids (GPUs, or CPU cores on CPU)"
    )
    serve.add_argument("--port", type=int, help="port to listen on (with --join: a free one by default)")
    serve.add_argument("--addr-file", help="write host:port here once the server is healthy")
    serve.add_argument(
        "--join",
        metavar="RUN_DIR",
        help="add one more server to the running run at RUN_DIR (its saved "
        "config; the trainer pushes it the current weights, then routes requests to it); stop it to "
        "drain it and leave",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="with --join: on stop, wait this long at most for its running requests",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="serve without an API key: every route (pausing, weight updates, code in its workers through "
        "/collective_rpc) is open to anyone who reaches the server's address. Without it the server takes "
        "$MEGARL_API_KEY, else {run_dir}/api_key (made when missing, mode 0600)",
    )
    _add_config_args(serve)
    serve.set_defaults(func=_cmd_serve)

    slurm = sub.add_parser("slurm", help="render the sbatch script of an experiment and submit it")
    slurm.add_argument("--dry-run", action="store_true", help="print the script instead of submitting it")
    slurm.add_argument(
        "--requeue", action="store_true", help="let Slurm requeue the job; it resumes (recover.mode=auto)"
    )
    slurm.add_argument("--output", help="where to write the script (default {run_dir}/job.sbatch)")
    slurm.add_argument(
        "--convert-point",
        action="store_true",
        help="submit `megarl convert-point` instead: the run's newest recover point rewritten on the ranks "
        "that wrote it (default script {run_dir}/convert.sbatch)",
    )
    _add_config_args(slurm, CONFIG_ARGS_HELP)
    slurm.set_defaults(func=_cmd_slurm)

    run = sub.add_parser("run", help="run an experiment on this machine: inference servers, then the trainer")
    run.add_argument(
        "--check",
        action="store_true",
        help="check the config and where each process would go on this machine, print what would start, and "
        "exit without starting or writing anything",
    )
    _add_config_args(run, CONFIG_ARGS_HELP)
    run.set_defaults(func=_cmd_run)

    convert = sub.add_parser(
        "convert-point",
        help="rewrite the run's newest recover point so that it resumes at another TP / PP / EP size "
        "(optimizer.checkpoint_layout=any), on as many ranks as wrote it",
    )
    _add_config_args(convert, CONFIG_ARGS_HELP)
    convert.set_defaults(func=_cmd_convert_point)

    watchdog = sub.add_parser(
        "watchdog", help="watch a Slurm job's trainer and servers for stalls (the sbatch script starts it)"
    )
    watchdog.add_argument(
        "--trainer-pid", type=int, required=True, help="the trainer step's srun: stopped on abort/restart"
    )
    _add_config_args(watchdog)
    watchdog.set_defaults(func=_cmd_watchdog)

    report = sub.add_parser("report", help="write RUN_DIR/report.html: curves, phases, staleness, gap, trajectories")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory ({fileroot}/{experiment}/{trial})")
    report.set_defaults(func=_cmd_report)

    plan = sub.add_parser("plan", help="predict step time from component rates; rank inference/training splits")
    plan.add_argument(
        "--rates", required=True, help="rates file (YAML/JSON): measured (benchmarks/plan.py --calibrate) or assumed"
    )
    plan.add_argument("--mode", help="predict this allocation_mode only (e.g. vllm:d48t2+megatron:d4p2t4)")
    plan.add_argument(
        "--devices", type=_positive_int, help="rank the splits of this many devices (default: the config's cluster)"
    )
    plan.add_argument(
        "--max-staleness", type=int, help="0: synchronous; >= 1: rollout overlaps training (default: the config's)"
    )
    plan.add_argument("--prompt-tokens", type=float, help="mean prompt tokens (default: the rates file's workload)")
    plan.add_argument(
        "--gen-tokens", type=float, help="mean generated tokens per sample (default: the rates file's workload)"
    )
    plan.add_argument("--top", type=_positive_int, default=10, help="how many splits to show")
    _add_config_args(plan, "key.path=value overrides of the --config files")
    plan.set_defaults(func=_cmd_plan)

    models = sub.add_parser("models", help="list or provision models known by short name, or fetch a hub id")
    models.add_argument("action", choices=["list", "fetch"])
    models.add_argument(
        "name",
        nargs="?",
        default="smollm2-135m-instruct",
        help="short name, HF directory, or hub id org/name[@revision] (into the HF cache)",
    )
    models.add_argument(
        "--cache-dir", help="where provisioned models go (default $MEGARL_CACHE_DIR or ~/.cache/megarl)"
    )
    models.set_defaults(func=_cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; user errors print one clear line and exit with status 2."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and not any(a.startswith("-") for a in extra):
        args.overrides += extra  # `run A.yaml --config B.yaml key=value`: argparse stops positionals at an option
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    console = Console(soft_wrap=True)
    if "" not in sys.path and os.getcwd() not in sys.path:
        # as `python -m megarl.train` (the trainer) does: a launcher.trainer_entry module is found
        # from the directory megarl runs in (plug-ins look there themselves: megarl.utils.plugins)
        sys.path.insert(0, os.getcwd())
    try:
        return args.func(args, console)
    except (ConfigError, AllocationError, ValueError, FileNotFoundError) as err:
        Console(stderr=True, soft_wrap=True).print(
            f"megarl {args.command}: error: {err}", markup=False, highlight=False
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
