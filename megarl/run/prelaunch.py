"""Pre-launch checks: what a config names, looked at before anything is launched.

``megarl.config`` checks a config's values and how they fit together. What the config *names*
is checked here, by reading it: the model directories (their ``config.json`` against the
allocation), the datasets (:mod:`megarl.run.dataset_check`: their split, their first rows
against ``type``, their size against the batch), the tokenizer, the directories the run writes, a
recover point to resume, the user's own code (reward, workflow, loss: imported, their signatures
checked), and the open files a trainer head needs (``RLIMIT_NOFILE``, :mod:`megarl.run.open_files`).
Hub ids become local snapshot directories here, and plug-in files absolute paths, so every process
of the run reads the same files.

They run where the config is loaded: ``megarl config``, ``megarl run`` and each trainer rank
(``megarl.train``) load it with :func:`load_expr_config`, which is
:func:`megarl.config.load_config_values` with these checks. Errors are
:class:`~megarl.config.ConfigError` naming the key, the value and the file.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import pickle
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

from megarl.api.workflow_api import is_agent, is_rollout_workflow
from megarl.config import loader
from megarl.config.allocation import AllocationError, ModelShape, validate_model
from megarl.config.base import ConfigError, require
from megarl.config.experiment import BaseExperimentConfig, GRPOConfig
from megarl.config.ppo import BUILTIN_LOSSES, USER_LOSS_CALL
from megarl.config.rollout import RUN_ARGUMENTS, RewardConfig, WorkflowConfig
from megarl.data.rows import REWARD_ARGUMENTS
from megarl.models.families import check_layers_hold
from megarl.models.names import MODEL_SHAPES, known_name, short_names
from megarl.models.peft_files import check_adapter_start
from megarl.models.provision import HUB_ID
from megarl.models.weight_files import weights_problem
from megarl.reward.call import TrainerState
from megarl.reward.executor import call_reward, call_reward_async, is_async_reward
from megarl.reward.failures import RewardFailure
from megarl.run.dataset_check import check_dataset
from megarl.run.earlier_run import has_recover_point, resumes
from megarl.run.open_files import check_open_files
from megarl.utils.logging import is_rank0
from megarl.utils.plugins import accepted_parameters, import_plugin, locate_plugin, signature_problem

logger = logging.getLogger("megarl.config")
T = TypeVar("T")

MODEL_SHORT_NAMES = {name: ModelShape(**MODEL_SHAPES[known_name(name)]) for name in short_names()}
"""Model short names (lower case) and the shapes that constrain a parallel layout (:mod:`megarl.models.names`)."""

MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
"""``model_type`` values megarl builds (``megarl.models.families.MODEL_FAMILIES``; a test checks they agree)."""
MODEL_INT_FIELDS = ("num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
"""Fields of ``config.json`` the Megatron build reads and HF gives no safe default for."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A tokenizer directory holds at least one of these (a fast tokenizer, a sentencepiece model, a BPE vocabulary)."""


def load_expr_config(argv: list[str], config_cls: type[T]) -> tuple[T, list[str]]:
    """:func:`megarl.config.load_config_values` with the pre-launch checks: the config the run uses
    (AReaL's ``load_expr_config``)."""
    return loader.load_config_values(argv, config_cls, prelaunch=PRELAUNCH)


def build_config(config_cls: type[T], files: list[str], overrides: list[str]) -> T:
    """:func:`megarl.config.build_config_values` with the pre-launch checks."""
    return loader.build_config_values(config_cls, files, overrides, prelaunch=PRELAUNCH)


class Prelaunch:
    """The loader's hooks (:class:`megarl.config.loader.PrelaunchHooks`): locations, then checks."""

    def resolve_locations(self, config: Any, folders: Callable[[str], list[Path]]) -> None:
        """Make every path the run's processes resolve the same wherever they start; before the checks.
        ``folders(key)``: the folder of the config file that set ``key``.

        A hub id in ``tokenizer_path``, ``actor.path``, ``ref.path``, ``critic.path`` or ``teacher.path`` becomes its
        local snapshot (:func:`resolve_hub_id`); each plug-in path found in a folder (the config
        file's, then the working directory) becomes the file's absolute path (:func:`locate_plugin`).
        """
        if not isinstance(config, BaseExperimentConfig):
            return
        multi_node = config.cluster.n_nodes > 1
        config.tokenizer_path = resolve_hub_id(config.tokenizer_path, "tokenizer_path", multi_node, weights=False)
        for key, data in (("train_dataset", config.train_dataset), ("valid_dataset", config.valid_dataset)):
            if data is not None:  # a row adapter's file
                data.type = locate_plugin(data.type, f"{key}.type", folders(f"{key}.type"))
        if not isinstance(config, GRPOConfig):
            return
        config.reward_fn = locate_plugin(config.reward_fn, "reward_fn", folders("reward_fn"))
        for key, workflow in (("workflow", config.workflow), ("eval_workflow", config.eval_workflow)):
            if workflow is None:
                continue
            workflow.type = locate_plugin(workflow.type, f"{key}.type", folders(f"{key}.type"))
            reward, reward_key = workflow.kwargs.get("reward_fn"), f"{key}.kwargs.reward_fn"
            if isinstance(reward, str):
                workflow.kwargs["reward_fn"] = locate_plugin(reward, reward_key, folders(reward_key))
        config.actor.loss = locate_plugin(config.actor.loss, "actor.loss", folders("actor.loss"))
        for key, model in (("actor", config.actor), ("ref", config.ref), ("critic", config.critic)):
            if model is not None:
                model.path = resolve_hub_id(model.path, f"{key}.path", multi_node)
        if config.teacher is not None and config.teacher.path:
            config.teacher.path = resolve_hub_id(config.teacher.path, "teacher.path", multi_node)

    def check(self, config: Any) -> None:
        """Everything ``config`` names exists and fits; after the config's own checks."""
        if not isinstance(config, BaseExperimentConfig):
            return
        multi_node = config.cluster.n_nodes > 1
        if isinstance(config, GRPOConfig):
            _check_loss(config.actor.loss, config.actor.loss_kwargs)
            for key, workflow in (("workflow", config.workflow), ("eval_workflow", config.eval_workflow)):
                if workflow is not None:
                    _check_workflow(key, workflow)
            _check_disk_path(config)
        row = check_dataset("train_dataset", config.train_dataset, multi_node)
        if config.valid_dataset is not None:
            check_dataset("valid_dataset", config.valid_dataset, multi_node)
        if config.tokenizer_path:
            problem = model_path_problem(config.tokenizer_path, multi_node, TOKENIZER_FILES)
            require(problem is None, "tokenizer_path", config.tokenizer_path, problem or "")
        _check_outputs(config, multi_node)
        if isinstance(config, GRPOConfig):
            _check_models(config)
            _check_recover_point(config)
            _check_adapter_starts(config, multi_node)
            _check_reward(config.reward_fn, row, config.reward)
            # several nodes: this may be a login node; each trainer rank refuses on its own node (megarl.train)
            check_open_files(config, refuse=not multi_node)


PRELAUNCH = Prelaunch()


def _check_outputs(config: BaseExperimentConfig, multi_node: bool) -> None:
    """The run directory can be written, and a ``recover.mode: resume`` has something to resume."""
    fileroot = config.cluster.fileroot
    if not (multi_node and Path(fileroot).is_absolute() and not Path(fileroot).exists()):  # maybe only on the nodes
        problem = writable_dir_problem(fileroot)
        require(problem is None, "cluster.fileroot", fileroot, f"the run's outputs go there: {problem}")
    points = config.run_dir / "recover"
    require(
        config.recover.mode != "resume"
        or has_recover_point(config.run_dir)
        or (multi_node and not config.run_dir.exists()),
        "recover.mode",
        config.recover.mode,
        f"nothing to resume: {points} holds no recover point (use 'auto' to resume when there is one)",
    )


def _check_disk_path(config: GRPOConfig) -> None:
    update = config.weight_update
    if "disk" in update.modes or config.adapter_sync:
        problem = writable_dir_problem(update.disk_path)
        require(
            problem is None, "weight_update.disk_path", update.disk_path, f"each update is written there: {problem}"
        )


def _check_models(config: GRPOConfig) -> None:
    alloc = config.allocation
    models = [("actor.path", config.actor.path)] + ([("ref.path", config.ref.path)] if config.ref else [])
    if config.critic is not None and config.critic.path:
        models.append(("critic.path", config.critic.path))
    if config.teacher is not None and config.teacher.path:
        models.append(("teacher.path", config.teacher.path))
    for key, path in models:
        problem = model_path_problem(path, config.cluster.n_nodes > 1)
        require(problem is None, key, path, problem or "")
        shape = read_model_shape(path, key)
        _check_model_files(config, key, Path(path).expanduser())
        if shape is not None and shape.vocab_size and key == "actor.path":
            too_big = [i for i in config.gconfig.stop_token_ids if i >= shape.vocab_size]
            require(
                not too_big,
                "gconfig.stop_token_ids",
                config.gconfig.stop_token_ids,
                f"ids {too_big} are beyond the vocabulary of {path} ({shape.vocab_size} tokens)",
            )
        if shape is not None and key == "actor.path":
            require(
                config.actor.routing_replay == "none" or shape.num_experts > 0,
                "actor.routing_replay",
                config.actor.routing_replay,
                f"replays the routing of a mixture-of-experts model; {path} has no experts",
                related=(key,),
            )
        if shape is not None:
            try:
                validate_model(alloc, shape)
            except AllocationError as err:
                raise ConfigError("allocation_mode", f"{err} (model {path})", related=(key,)) from None


def _check_model_files(config: GRPOConfig, key: str, local: Path) -> None:
    """A local model's weights are whole (headers read); the actor's has a tokenizer, or ``tokenizer_path`` one."""
    block = {"actor.path": config.actor, "ref.path": config.ref, "critic.path": config.critic}.get(key)
    if not (local / "config.json").is_file():
        return  # a short name (provisioned when the run starts), or a path only the nodes see
    problem = None if getattr(block, "init_from_scratch", False) else weights_problem(local)
    require(problem is None, key, str(local), problem or "")
    tokenizer = key != "actor.path" or config.tokenizer_path or any((local / f).is_file() for f in TOKENIZER_FILES)
    require(bool(tokenizer), "tokenizer_path", "", f"{local} has no tokenizer (none of {TOKENIZER_FILES})", (key,))


def _check_recover_point(config: GRPOConfig) -> None:
    """The recover point the run would resume from loads into its models at its layout
    (:func:`megarl.run.recover.check_point_loads`); before anything starts."""
    if not resumes(config):
        return  # reading a point imports Megatron: only when there is one
    with warnings.catch_warnings():  # Megatron's import says TransformerEngine / Apex are missing: the log's
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed", category=UserWarning)
        from megarl.run.recover import check_point_loads
    check_point_loads(config)


def _check_adapter_starts(config: GRPOConfig, multi_node: bool) -> None:
    """The actor's and the critic's ``lora.init_from`` (:func:`~megarl.models.peft_files.check_adapter_start`)."""
    for key, model in (("actor", config.actor), ("critic", config.critic)):
        if model is not None and model.lora.init_from:
            shape = read_model_shape(model.path or config.actor.path)
            moe = None if shape is None else shape.num_experts > 0
            check_adapter_start(model.lora, multi_node, moe, f"{key}.lora")


REWARD_ROLES = dict(
    zip(REWARD_ARGUMENTS, ("prompt text", "completion text", "prompt's token ids", "completion's token ids"))
)


def _check_reward(reward_fn: str, row: dict | None, reward: RewardConfig) -> None:
    """The reward takes the call the run makes: ``fn(prompt, completions, prompt_ids, completion_ids,
    **row, **reward.kwargs)`` with the dataset's first row (when it can be read here), so a row column
    or a ``reward.kwargs`` name that lands on one of its four positional parameters, and a
    ``reward.kwargs`` name that is also a row column, are refused here, naming both, not at every call;
    then it is called so (:func:`_check_reward_call`)."""
    fn = import_plugin(reward_fn, "reward_fn")
    expected = "expected fn(prompt, completions, prompt_ids, completion_ids, **row) -> float"
    positional = _positional_names(fn)
    columns = list(row or {})
    clash = [(column, i) for i, column in enumerate(positional[:4]) if column in columns]
    require(
        not clash,
        "reward_fn",
        reward_fn,
        "; ".join(
            f"the dataset's rows have a column {column!r}, and the reward's parameter {column!r} receives the "
            f"{list(REWARD_ROLES.values())[i]} (argument {i + 1}): rename the column (a row adapter) or the parameter"
            for column, i in clash
        ),
    )
    taken = [name for name in reward.kwargs if name in positional[:4] or name in REWARD_ARGUMENTS]
    require(not taken, "reward.kwargs", reward.kwargs, f"{taken}: the reward's four positional arguments' names")
    shadowed = [name for name in reward.kwargs if name in columns]
    require(
        not shadowed,
        "reward.kwargs",
        reward.kwargs,
        f"{shadowed} {'is' if len(shadowed) == 1 else 'are'} also the dataset's row column(s): rename one",
    )
    args, kwargs = ("prompt", "completion", [], []), {**(row or {}), **reward.kwargs}
    problem = signature_problem(fn, args, kwargs, partial=row is None)
    require(problem is None, "reward_fn", reward_fn, f"{expected}: {problem}")
    if row is not None:
        _check_reward_call(reward_fn, fn, row, reward)


def _check_reward_call(reward_fn: str, fn: Callable, row: dict, reward: RewardConfig) -> None:
    """Call the reward once on the dataset's first row, as the run would: a plain function sent through
    pickle, as to a reward worker; an ``async def`` one awaited (so a reward service or judge that cannot
    be reached is found now); under its timeout, at ``trainer_state`` global step 0 (max_steps 0: the run's
    length is not known yet). No server has generated a completion yet, so the prompt is the row's
    messages as text and the completion a stand-in: the row's ``answer`` as text, with no token ids.
    Refused: a reward that cannot be sent, raises, or returns no finite number; one past its timeout is
    only warned about."""
    completion = str(row.get("answer", ""))
    args, kwargs = (_stand_in_prompt(row), completion, [], []), {**row, **reward.kwargs}
    if is_async_reward(fn):
        result, _ = asyncio.run(call_reward_async(fn, args, kwargs, reward.timeout_seconds, TrainerState()))
    else:
        try:
            sent = pickle.loads(pickle.dumps(fn))
        except Exception as e:  # noqa: BLE001 -- whatever pickle raises, the reward cannot reach the workers
            raise ConfigError(
                "reward_fn", f"{reward_fn!r} cannot be sent to the reward worker processes (pickle): {e!r}"
            ) from None
        result, _ = call_reward(sent, args, kwargs, reward.timeout_seconds, TrainerState())
    called = f"called on the dataset's first row with the stand-in completion {completion!r:.60}"
    if isinstance(result, RewardFailure) and result.kind == "timeout":
        logger.warning(
            "reward_fn %s ran past reward.timeout_seconds=%g s when %s", reward_fn, reward.timeout_seconds, called
        )
    elif isinstance(result, RewardFailure):
        what = (
            "it raised:\n" + result.detail.rstrip()
            if result.kind == "raised"
            else f"it returned {result.detail}, not a finite number"
        )
        raise ConfigError("reward_fn", f"{reward_fn!r} failed when {called}: {what}")


def _stand_in_prompt(row: dict) -> str:
    """The row's chat as text, one message a line (the run passes the chat-templated prompt)."""
    messages = row.get("messages")
    turns = messages if isinstance(messages, list) else []
    return "\n".join(str(turn.get("content", "")) for turn in turns if isinstance(turn, dict))


def _positional_names(fn) -> list[str]:
    """The names of ``fn``'s positional-or-keyword parameters, in order ([] without a signature)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


def _check_loss(loss: str, loss_kwargs: dict[str, Any]) -> None:
    """A user's ``actor.loss`` imports and takes the surrogate's arguments and ``actor.loss_kwargs``."""
    if loss in BUILTIN_LOSSES:
        return
    fn = import_plugin(loss, "actor.loss")
    try:
        accepted = accepted_parameters(fn)
    except (TypeError, ValueError):  # not callable, or no signature to read: signature_problem says which
        accepted = None
    unknown = [] if accepted is None else sorted(set(loss_kwargs) - accepted)
    if unknown:
        raise ConfigError(
            f"actor.loss_kwargs.{unknown[0]}",
            f"actor.loss={loss!r} ({getattr(fn, '__qualname__', fn)}) takes no keyword argument(s) {unknown}; "
            f"its own keyword parameters are {_loss_keywords(fn)}",
            related=("actor.loss",),
        )
    args, kwargs = (None, None, None, None), {"cu_seqlens": None, "config": None, **loss_kwargs}
    problem = signature_problem(fn, args, kwargs)
    require(
        problem is None,
        "actor.loss",
        loss,
        f"expected {USER_LOSS_CALL} with actor.loss_kwargs {sorted(loss_kwargs)}: {problem}",
    )


def _loss_keywords(fn: Any) -> list[str]:
    """The parameters of a loss function that ``actor.loss_kwargs`` may set: past the four tensors,
    other than ``cu_seqlens`` and ``config``."""
    parameters = list(inspect.signature(fn).parameters.values())
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:4]
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in parameters
        if p.kind in keyword and p not in positional and p.name not in ("cu_seqlens", "config")
    ]


def _check_workflow(key: str, workflow: WorkflowConfig) -> None:
    problem = workflow_problem(workflow.class_path, workflow.kwargs, f"{key}.type")
    require(problem is None, f"{key}.type", workflow.type, problem or "")
    _check_export_style(key, workflow)


def _check_export_style(key: str, workflow: WorkflowConfig) -> None:
    """An :class:`~megarl.workflow.openai_agent.OpenAIAgentWorkflow` of the user's exports rows the trainer takes."""
    agent_module = sys.modules.get("megarl.workflow.openai_agent")  # unimported: no class of the config extends it
    cls = import_plugin(workflow.class_path, f"{key}.type")
    if agent_module is None or not issubclass(cls, agent_module.OpenAIAgentWorkflow):
        return
    parameter = inspect.signature(cls).parameters.get("export_style")
    default = None if parameter is None else parameter.default
    style = workflow.kwargs.get("export_style", default)
    problem = agent_module.trainer_export_problem(style) if isinstance(style, str) else None
    where = f"{key}.kwargs.export_style" if "export_style" in workflow.kwargs else f"{key}.type"
    require(problem is None, where, style if "export_style" in workflow.kwargs else workflow.type, problem or "")


def workflow_problem(class_path: str, kwargs: dict[str, Any], key: str) -> str | None:
    """Why ``class_path`` built with ``kwargs`` (and the run's arguments) is neither a workflow nor an
    agent (which runs behind the OpenAI-compatible proxy), else None."""
    cls = import_plugin(class_path, key)
    if not inspect.isclass(cls):
        return f"{class_path!r} is not a class"
    if not (is_rollout_workflow(cls) or is_agent(cls)):
        return (
            f"{cls.__qualname__} has no 'async def arun_episode(self, engine, data)' (see RolloutWorkflow), "
            "nor an agent's 'async def run(self, data, **extra_kwargs)' (see megarl.workflow.openai_agent)"
        )
    accepted = accepted_parameters(cls)
    if accepted is not None:
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            return f"{cls.__qualname__} takes no argument(s) {unknown}; it takes {sorted(accepted)}"
    run = {name: None for name in RUN_ARGUMENTS if accepted is not None and name in accepted and name not in kwargs}
    return signature_problem(cls, (), {**run, **kwargs})


def read_model_config(path: str, key: str) -> dict | None:
    """The ``config.json`` of the model directory ``path`` (None when it has none), checked for the
    fields the build needs. A :class:`ConfigError` naming ``key`` and the file otherwise."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(key, f"{path!r}: cannot read {file}: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(key, f"{path!r}: {file} holds a {type(config).__name__}, expected a JSON object")
    problems = []
    if config.get("model_type") not in MODEL_TYPES:
        problems.append(f"model_type {config.get('model_type')!r} is not one of {list(MODEL_TYPES)}")
    for name in (*MODEL_INT_FIELDS, "num_key_value_heads"):
        value = config.get(name)
        if (value is not None or name != "num_key_value_heads") and not (type(value) is int and value >= 1):
            problems.append(f"{name}={value!r} (expected an integer >= 1)")
    if not problems:
        try:
            check_layers_hold(SimpleNamespace(**config))
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError(key, f"{path!r}: {file} cannot build a model: {'; '.join(problems)}")
    return config


def writable_dir_problem(path: str) -> str | None:
    """Why a run cannot create and write files under the directory ``path``, or None.

    Tried for real (a temporary file in ``path`` or in its nearest existing parent), since
    permission bits say nothing for root or a read-only mount.
    """
    directory = Path(path).expanduser().absolute()
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return f"{existing} is a file, not a directory" if existing else "no parent directory exists"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"cannot write in {existing}: {err.strerror or err}"
    return None


def read_model_shape(path: str, key: str = "actor.path") -> ModelShape | None:
    """The model's :class:`ModelShape` for a known short name or a local HF directory, else None.

    A ``config.json`` that cannot build a model is a :class:`ConfigError` naming ``key`` and the file.
    """
    if path.lower() in MODEL_SHORT_NAMES:
        return MODEL_SHORT_NAMES[path.lower()]
    config = read_model_config(path, key)
    return None if config is None else ModelShape.from_hf_config(config)


def resolve_hub_id(path: str, key: str, multi_node: bool, weights: bool = True) -> str:
    """``path``, or its local snapshot directory when it is a Hugging Face hub id (``org/name[@revision]``)
    rather than a short name or an existing path (:func:`megarl.models.provision.hub_snapshot`:
    from the cache, else downloaded). ``weights``: a model (config and safetensors), else a tokenizer.

    Resolved once, when the config loads: the saved config hands the trainer and the servers
    the same directory. A :class:`ConfigError` naming ``key`` when it cannot be had.
    """
    local = Path(path).expanduser()
    if (
        not HUB_ID.fullmatch(path)
        or path.lower() in MODEL_SHORT_NAMES
        or local.exists()
        or (multi_node and local.is_absolute())
    ):
        return path
    from megarl.models.provision import HubModelError, hub_snapshot

    try:
        snapshot = str(hub_snapshot(path, weights=weights))
    except HubModelError as err:
        raise ConfigError(
            key,
            f"{path!r} is no local directory nor a known short name {sorted(MODEL_SHORT_NAMES)}; "
            f"as a Hugging Face hub id: {err}",
        ) from None
    if is_rank0():
        logger.info("%s: hub id %s is %s", key, path, snapshot)
    return snapshot


def model_path_problem(path: str, multi_node: bool, marker_files: tuple[str, ...] = ("config.json",)) -> str | None:
    """Why ``path`` cannot name a model (or tokenizer) of this run, or None when it can.

    Accepted: a short name of :data:`MODEL_SHORT_NAMES`, or a directory holding one of
    ``marker_files``. A hub id (``org/name``) is turned into its local snapshot directory when
    the config loads (:func:`resolve_hub_id`), so the trainer and the servers read the same
    files and no hub is reached at run time; one reaching here was not loaded. One exception: an absolute path that does not exist here is
    accepted on a multi-node cluster, whose nodes may mount shared storage this machine
    (e.g. a Slurm login node) does not; the servers and trainer check it again there.
    """
    if path.lower() in MODEL_SHORT_NAMES:
        return None
    local = Path(path).expanduser()
    if any((local / name).is_file() for name in marker_files):
        return None
    known = sorted(MODEL_SHORT_NAMES)
    if local.is_dir():
        return f"this directory has no {' or '.join(marker_files)}; expected an HF model directory or one of {known}"
    if local.exists():
        return f"this is a file; expected an HF model directory or one of {known}"
    if local.is_absolute() and multi_node:
        return None
    hint = (
        "; a Hugging Face hub id becomes its local directory when the config is loaded (megarl.run.prelaunch.load_expr_config)"
        if HUB_ID.fullmatch(path)
        else ""
    )
    return f"neither a known short name {known} nor a directory with {' or '.join(marker_files)}{hint}"
