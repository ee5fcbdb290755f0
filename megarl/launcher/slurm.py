"""Render (and submit) the sbatch script of an experiment.

The script is self-contained and readable, so it can be edited and resubmitted by
hand (``launch/`` holds rendered examples). Its shape:

1. one ``srun`` step per inference server (``megarl serve``), on the node and
   devices the placement plan gives it; each writes its address to
   ``{run_dir}/servers/{i}.addr`` once healthy; a server step that ends is started
   again in its slot (``launcher.server_restarts``, ``launcher.max_server_restarts``)
   and recorded in ``{run_dir}/server_restarts.jsonl`` for the trainer;
2. wait until every server wrote its address (or one step died, or a deadline);
3. one ``srun`` step running ``torchrun`` on the training nodes, with the
   servers' addresses in ``MEGARL_LLM_SERVER_ADDRS`` in slot order: server i is slot i everywhere
   (``servers/{i}.addr``, ``slurm/server-{i}-<job>.log``, its restart records, the trainer's ``server-{i}``);
4. the first step to end decides: the trainer finishing ends the job with its exit
   status; a server slot out of restarts ending first fails the job. Everything left is stopped.

Beside the trainer, ``megarl watchdog`` runs on the batch host (``watchdog.*``): it reads the ranks'
heartbeats from the shared run directory, beats for the servers on their health checks, names a
stall in the job's output, and under ``abort`` stops the trainer (exit 3) or under ``restart``
requeues the job. On GPUs every rank keeps NCCL's flight recorder for it.

With ``--requeue`` a preempted or failed job comes back and the trainer resumes
from its recover checkpoint (``recover.mode`` must be ``auto``).
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from megarl.config.experiment import GRPOConfig
from megarl.launcher.placement import Placement, plan_placement
from megarl.run.earlier_run import LOCK_FILE
from megarl.serving.restarts import RESTARTS_FILE
from megarl.utils.auth import API_KEY_ENV, KEY_FILE
from megarl.utils.heartbeat import flight_recorder_env
from megarl.utils.network import INTERFACE_ENV


def _sbatch_header(config: GRPOConfig, requeue: bool, nodes: int | None = None, job: str = "") -> list[str]:
    """``nodes``: the job's node count (default the cluster's); ``job``: a suffix of its name."""
    slurm = config.launcher.slurm
    run_dir = config.run_dir.resolve()
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={config.experiment_name}-{config.trial_name}{job}",
        f"#SBATCH --nodes={nodes or config.cluster.n_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={slurm.time_limit}",
        f"#SBATCH --output={run_dir}/slurm/%j.out",
        "#SBATCH --open-mode=append",
    ]
    if config.cluster.device != "cpu":
        lines.append(f"#SBATCH --gpus-per-node={config.cluster.n_gpus_per_node}")
    optional = {
        "--partition": slurm.partition,
        "--account": slurm.account,
        "--qos": slurm.qos,
        "--cpus-per-task": slurm.cpus_per_node,
        "--mem": slurm.mem,
    }
    lines += [f"#SBATCH {flag}={value}" for flag, value in optional.items() if value is not None]
    if slurm.exclusive:
        lines.append("#SBATCH --exclusive")
    if requeue:
        lines.append("#SBATCH --requeue")
    lines += [f"#SBATCH {arg}" for arg in slurm.extra_sbatch_args]
    return lines


def _body(config: GRPOConfig, config_file: Path, plan: Placement, requeue: bool = False) -> list[str]:
    slurm = config.launcher.slurm
    run_dir = config.run_dir.resolve()
    cfg = shlex.quote(str(config_file))
    lines = _job_environment(config)
    lines += [
        "# the run's API key: servers refuse requests without it (megarl.utils.auth); kept out of the script",
        f'export {API_KEY_ENV}="${{{API_KEY_ENV}:-$(python3 -c "import secrets; print(secrets.token_urlsafe(32))")}}"',
        f"RUN_DIR={shlex.quote(str(run_dir))}",
        'mkdir -p "$RUN_DIR/servers" "$RUN_DIR/slurm"',
        *_hold_run_dir(),
        f'(umask 077; echo "${API_KEY_ENV}" > "$RUN_DIR/{KEY_FILE}")  # the key of servers that join the run later',
        'rm -f "$RUN_DIR"/servers/*.addr "$RUN_DIR/watchdog.stopped"',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "PIDS=()",
        'cleanup() { for pid in "${PIDS[@]}" ${WATCHDOG:-}; do kill -TERM "$pid" 2>/dev/null; done; wait; }',
        "trap cleanup EXIT",
        "",
        "# 1. inference servers",
    ]
    lines.append("# index node devices port (node: index into NODES)")
    lines.append("SERVERS=(")
    for slot in plan.servers:
        devices = ",".join(map(str, slot.devices))
        lines.append(f'  "{slot.index} {slot.node} {devices} {slurm.server_port + slot.devices[0]}"')
    lines += [
        ")",
        *_serve_slot(config, cfg),
        'for server in "${SERVERS[@]}"; do',
        "  serve_slot $server &",
        "  PIDS+=($!)",
        "done",
    ]
    if plan.servers:
        lines += _wait_for_servers(slurm.server_wait_timeout, config.rollout.server_addrs_env)
    lines += ["", "# 3. trainer", *_flight_recorder(config), *_trainer(config, cfg, plan), *_watchdog(config, cfg)]
    lines += ["", "# 4. the first step to end decides the job's fate", *_first_exit(config, requeue)]
    return lines


def _hold_run_dir() -> list[str]:
    """The job holds ``$RUN_DIR`` while it runs, as ``megarl run`` does (an exclusive ``flock`` on its lock
    file, :func:`megarl.run.earlier_run.lock_run_dir`): a second start of the trial is refused, and this job
    ends at once if another run holds it. A filesystem without ``flock`` support runs unguarded, warned."""
    lock = f'"$RUN_DIR/{LOCK_FILE}"'
    return [
        "# the run directory is this job's while it runs: a second start of the trial is refused",
        f"exec {{RUN_LOCK}}>>{lock}",
        'flock -n -E 75 "$RUN_LOCK"; locked=$?',
        'if [ "$locked" = 75 ]; then',
        f'  echo "megarl: $RUN_DIR is in use by a run that is still going ($(cat {lock})); this job ends" >&2',
        "  exit 1",
        'elif [ "$locked" != 0 ]; then',
        '  echo "megarl: cannot lock $RUN_DIR (no flock on this filesystem?): a second start would not see this" >&2',
        "else",
        f'  echo "slurm job $SLURM_JOB_ID on $(hostname), since $(date +%Y-%m-%dT%H:%M:%S)" > {lock}',
        "fi",
    ]


def _job_environment(config: GRPOConfig) -> list[str]:
    """The job's first lines: strict bash, ``launcher.slurm.setup``, ``launcher.env``, the cluster interface."""
    slurm = config.launcher.slurm
    lines = ["set -uo pipefail", *slurm.setup]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in config.launcher.env.items()]
    return lines + _interface_env(slurm.network_interface, config.launcher.env)


def _flight_recorder(config: GRPOConfig) -> list[str]:
    """NCCL's flight recorder in every CUDA rank; the watchdog asks for its dump (``{run_dir}/nccl_trace/``)."""
    if config.cluster.device == "cpu" or not config.watchdog.enabled:
        return []
    env = flight_recorder_env(config.run_dir.resolve())
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items() if k not in config.launcher.env]


def _watchdog(config: GRPOConfig, cfg: str) -> list[str]:
    """The hang watchdog on this (the batch) host: names stalled ranks and servers in the job's output."""
    if not config.watchdog.enabled:
        return []
    return [
        f"# the hang watchdog (watchdog.action={config.watchdog.action}): stalls named in this output, stacks in $RUN_DIR/stacks",
        f'megarl watchdog --config {cfg} --trainer-pid "$TRAINER" &',
        "WATCHDOG=$!",
    ]


def _serve_slot(config: GRPOConfig, cfg: str) -> list[str]:
    """``serve_slot IDX NODE DEVICES PORT``: a server step, started again in its slot when it ends,
    up to ``launcher.server_restarts`` times (``launcher.max_server_restarts`` for the run: the lines of
    ``{run_dir}/server_restarts.jsonl``, which tell the trainer to push its weights to the new one)."""
    launcher = config.launcher
    per_server, per_run = launcher.server_restarts, launcher.max_server_restarts
    return [
        f"# a server step that ends is started again in its slot: launcher.server_restarts={per_server} per server,",
        f"# launcher.max_server_restarts={per_run} per run (the lines of $RUN_DIR/{RESTARTS_FILE})",
        "serve_slot() {",
        "  local idx=$1 node=$2 devices=$3 port=$4 n=0 status total",
        "  while true; do",
        '    srun --overlap --nodes=1 --ntasks=1 -w "${NODES[$node]}" --output="$RUN_DIR/slurm/server-$idx-%j.log" \\',
        f'      megarl serve --config {cfg} --index "$idx" --devices "$devices" --port "$port" \\',
        '      --addr-file "$RUN_DIR/servers/$idx.addr"',
        "    status=$?",
        f'    total=$(cat "$RUN_DIR/{RESTARTS_FILE}" 2>/dev/null | wc -l)',
        f"    if [ $n -ge {per_server} ]; then",
        f'      echo "megarl: server-$idx step ended with status $status; not restarted: launcher.server_restarts={per_server} restarts of server-$idx are spent" >&2',
        "      return $status",
        f"    elif [ $total -ge {per_run} ]; then",
        f'      echo "megarl: server-$idx step ended with status $status; not restarted: launcher.max_server_restarts={per_run} restarts of this run are spent" >&2',
        "      return $status",
        "    fi",
        "    n=$((n + 1))",
        f'    echo "megarl: server-$idx step ended with status $status; restarting it in its slot (restart $n of {per_server} for it, $((total + 1)) of {per_run} this run)" >&2',
        '    printf \'{"time": %s, "server": "server-%s", "address": "%s", "exit_code": %s, "restart": %s, "run_total": %s}\\n\' \\',
        f'      "$(date +%s)" "$idx" "$(cat "$RUN_DIR/servers/$idx.addr" 2>/dev/null)" "$status" "$n" "$((total + 1))" >> "$RUN_DIR/{RESTARTS_FILE}"',
        "  done",
        "}",
    ]


def _wait_for_servers(timeout: int, addrs_env: str) -> list[str]:
    """Wait for every slot's address, then list them in slot order: the trainer's ``server-i`` (the i-th of
    ``MEGARL_LLM_SERVER_ADDRS``) is slot i, not the i-th file of a glob (0, 1, 10, 11, ..., 2). The list
    is also exported as ``addrs_env`` (``rollout.server_addrs_env``), where the trainer reads it."""
    also = [f'export {addrs_env}="$MEGARL_LLM_SERVER_ADDRS"'] if addrs_env != "MEGARL_LLM_SERVER_ADDRS" else []
    return [
        "",
        "# 2. wait until every server is healthy (each wrote its address to $RUN_DIR/servers/<slot>.addr)",
        "# the trainer's server-i is the i-th address: slot i (its log slurm/server-i-<job>.log, its restart records)",
        "server_addrs() {  # the servers' addresses in slot order; fails naming the slots without one",
        "  local server idx addrs=() missing=()",
        '  for server in "${SERVERS[@]}"; do',
        "    idx=${server%% *}",
        '    if [ -s "$RUN_DIR/servers/$idx.addr" ]; then',
        '      addrs+=("$(< "$RUN_DIR/servers/$idx.addr")")',
        "    else",
        '      missing+=("server-$idx")',
        "    fi",
        "  done",
        '  [ ${#missing[@]} -eq 0 ] || { echo "megarl: no address yet from ${missing[*]}" >&2; return 1; }',
        '  (IFS=,; echo "${addrs[*]}")',
        "}",
        f"deadline=$((SECONDS + {timeout}))",
        "until MEGARL_LLM_SERVER_ADDRS=$(server_addrs 2>/dev/null); do",
        '  for pid in "${PIDS[@]}"; do',
        '    kill -0 "$pid" 2>/dev/null || { echo "megarl: a server step exited before it was healthy" >&2; exit 1; }',
        "  done",
        f'  [ $SECONDS -lt $deadline ] || {{ server_addrs >/dev/null; echo "megarl: servers not healthy after {timeout} s" >&2; exit 1; }}',
        "  sleep 2",
        "done",
        "export MEGARL_LLM_SERVER_ADDRS",
        *also,
        'echo "megarl: servers at $MEGARL_LLM_SERVER_ADDRS"',
    ]


def _interface_env(interface: str | None, env: dict[str, str]) -> list[str]:
    """gloo and NCCL on the cluster interface the servers bind, and every address megarl announces
    (the weight bridge's too: :func:`megarl.utils.network.gethostip`)."""
    if interface is None:
        return []
    names = [n for n in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", INTERFACE_ENV) if n not in env]
    lines = ["# collectives on the cluster interface (launcher.slurm.network_interface)"]
    return lines + [f"export {n}={shlex.quote(interface)}" for n in names] if names else []


def _trainer(config: GRPOConfig, cfg: str, plan: Placement) -> list[str]:
    entry = config.launcher.trainer_entry
    target = shlex.quote(entry) if entry.endswith(".py") else f"-m {shlex.quote(entry)}"
    nodes = plan.trainer_nodes
    visible = ""
    if config.cluster.device != "cpu" and len(nodes) == 1 and config.cluster.n_nodes == 1:
        visible = f"CUDA_VISIBLE_DEVICES={','.join(map(str, plan.trainer_devices))} "
    return _torchrun_step(config, nodes, plan.trainer_procs_per_node, f"{target} --config {cfg}", visible)


def _torchrun_step(config: GRPOConfig, nodes: list[int], procs_per_node: int, command: str, visible: str) -> list[str]:
    """One ``srun`` step of ``torchrun`` running ``command`` on ``nodes`` (indexes into NODES), in the
    background as ``$TRAINER``."""
    slurm = config.launcher.slurm
    node_list = ",".join(f"${{NODES[{n}]}}" for n in nodes)
    # a static rendezvous on the step's first node (SLURM_NODEID counts the step's nodes from 0): the
    # c10d one's store lives in that node's agent, which may exit first and fail the others' shutdown
    torchrun = (
        f"{visible}torchrun --nnodes={len(nodes)} --nproc-per-node={procs_per_node} "
        f"--node-rank=$SLURM_NODEID --master-addr=$MEGARL_TRAIN_MASTER --master-port={slurm.trainer_port} "
        f"--rdzv-conf=timeout={slurm.rendezvous_timeout} "
        f"--log-dir={shlex.quote(str(config.run_dir.resolve() / 'logs' / 'torchrun'))} {command}"
    )
    return [
        f'export MEGARL_TRAIN_MASTER="${{NODES[{nodes[0]}]}}"',
        f'srun --overlap --nodes={len(nodes)} --ntasks={len(nodes)} --ntasks-per-node=1 -w "{node_list}" '
        f"--kill-on-bad-exit=1 bash -c {shlex.quote(torchrun)} &",
        "TRAINER=$!",
    ]


def _first_exit(config: GRPOConfig, requeue: bool = False) -> list[str]:
    watchdog = []
    if config.watchdog.enabled and config.watchdog.action != "warn":
        restart = []
        if config.watchdog.action == "restart":  # render_sbatch made sure the job may be requeued
            restart = [
                '  echo "megarl: requeueing the job: it resumes from its last recover point" >&2',
                '  scontrol requeue "$SLURM_JOB_ID"',
            ]
        watchdog = [
            'if [ -f "$RUN_DIR/watchdog.stopped" ]; then',
            '  echo "megarl: the watchdog stopped the trainer (watchdog.action=$(cat "$RUN_DIR/watchdog.stopped"))" >&2',
            *restart,
            "  exit 3",
            "fi",
        ]
    return [
        'wait -n "$TRAINER" "${PIDS[@]}"',
        'if kill -0 "$TRAINER" 2>/dev/null; then',
        '  echo "megarl: a server step ended during training and its restarts are spent; failing the job" >&2',
        '  kill -TERM "$TRAINER"; exit 1',
        "fi",
        'wait "$TRAINER"; status=$?',
        *watchdog,
        'echo "megarl: trainer exited with status $status"',
        *_requeue_on_failure(config, requeue),
        "exit $status",
    ]


def _requeue_on_failure(config: GRPOConfig, requeue: bool) -> list[str]:
    """With ``--requeue``, a trainer that failed (a node lost, a rank killed) brings the job back to resume
    from its recover point, up to ``recover.retries`` times (Slurm itself requeues only on node failure
    or preemption)."""
    if not requeue:
        return []
    retries = config.recover.retries
    return [
        f'if [ "$status" -ne 0 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {retries} ]; then',
        f'  echo "megarl: requeueing the job (restart $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) of {retries}, '
        'recover.retries): it resumes from its last recover point" >&2',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
    ]


def render_sbatch(config: GRPOConfig, config_file: Path, *, requeue: bool = False) -> str:
    """The sbatch script of ``config``; every step reads the resolved config at ``config_file``."""
    if requeue and config.recover.mode != "auto":
        raise ValueError(
            f"--requeue needs recover.mode=auto so a requeued job resumes, got recover.mode={config.recover.mode!r}"
        )
    if config.watchdog.enabled and config.watchdog.action == "restart" and not requeue:
        raise ValueError(
            "watchdog.action=restart under Slurm requeues the job: render it with --requeue "
            "(and recover.mode=auto), or use watchdog.action=abort"
        )
    plan = plan_placement(config.allocation, config.cluster.n_nodes, config.cluster.n_gpus_per_node)
    return "\n".join(_sbatch_header(config, requeue) + [""] + _body(config, config_file, plan, requeue)) + "\n"


def render_convert_sbatch(config: GRPOConfig, config_file: Path, world_size: int) -> str:
    """The sbatch script that converts the run's newest recover point (``megarl convert-point``) on the
    ``world_size`` ranks that wrote it: a GPU node's devices each, or every rank on one node on CPU."""
    per_node = world_size if config.cluster.device == "cpu" else min(world_size, config.cluster.n_gpus_per_node)
    if world_size % per_node:
        raise ValueError(
            f"the recover point was written by {world_size} ranks, which {per_node} GPUs a node "
            f"(cluster.n_gpus_per_node) do not divide: convert it with `python -m megarl.run.convert_point` by hand"
        )
    nodes = world_size // per_node
    body = [
        *_job_environment(config),
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "",
        f"# the newest recover point, rewritten in place with the optimizer state per parameter ({world_size} ranks)",
        *_torchrun_step(
            config,
            list(range(nodes)),
            per_node,
            f"-m megarl.run.convert_point --config {shlex.quote(str(config_file))}",
            "",
        ),
        'wait "$TRAINER"; status=$?',
        'echo "megarl: the conversion exited with status $status"',
        "exit $status",
    ]
    return "\n".join(_sbatch_header(config, False, nodes=nodes, job="-convert") + [""] + body) + "\n"


def submit(script: str, path: Path) -> str:
    """Write ``script`` to ``path`` and ``sbatch`` it; returns the job id."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    result = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"sbatch {path} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip().split(";")[0]


if __name__ == "__main__":  # AReaL's `python -m areal.launcher.slurm <script> --config <file> [key=value ...]`
    from megarl.launcher import areal_command

    areal_command.main("slurm")
