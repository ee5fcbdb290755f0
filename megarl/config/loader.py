"""Load an experiment config from YAML files plus ``key=value`` overrides, checking its values.

    config, rest = load_config_values(["--config", "configs/gsm8k_grpo_cpu.yaml", "actor.optimizer.lr=2e-6"], GRPOConfig)

Layers, later winning: the dataclass defaults, each ``--config`` file in order (so a
parallel-strategy preset can follow an experiment file), then the overrides. The
merge is an OmegaConf structured config, so a misspelled key or a value of the
wrong type fails with its full key path; then every config's ``check()`` runs, and the
experiment's ``resolve_auto()`` (if it has one) makes machine-dependent values concrete.

What the config names (files, models, datasets, hubs, the user's code) is not read here: a
caller that launches a run passes ``prelaunch`` hooks (:class:`PrelaunchHooks`;
``megarl.run.prelaunch.load_expr_config``, AReaL's name and the loader a run uses, does), which
resolve those names into paths every process finds before the checks and check them after the
config's own. Hence the names here: :func:`load_config_values` and :func:`build_config_values`
(``load_expr_config`` and ``build_config`` before; the old names still work, with a warning).

AReaL's names for a few keys are accepted (:data:`AREAL_ALIASES`): each layer's AReaL
key is renamed to megarl's before the merge, with one INFO line saying so.
"""

from __future__ import annotations

import argparse
import functools
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.base import ConfigError, validate_tree

T = TypeVar("T")

logger = logging.getLogger("megarl.config")

AREAL_ALIASES: dict[str, str] = {
    "rollout.dump_to_file": "rollout.dump_trajectories",
    "rollout.fileroot": "cluster.fileroot",
    "rollout.tokenizer_path": "tokenizer_path",
    "rollout.group_size": "workflow.group_size",
    "rollout.max_head_offpolicyness": "rollout.max_staleness",
}
"""AReaL key -> megarl key of the same meaning, so that an AReaL YAML or command line loads.

megarl keeps one output root (dumps go to ``{cluster.fileroot}/{experiment}/{trial}/rollout``),
one tokenizer (the dumper decodes with ``tokenizer_path``), and sets AReaL's grouped rollout
(the workflow run N times per prompt) on the workflow it groups. AReaL's usual
``fileroot: ${cluster.fileroot}`` (an interpolation of the megarl key) is simply dropped;
an alias contradicting its megarl key in the same layer is an error.
"""


class PrelaunchHooks(Protocol):
    """What a caller that launches a run adds to loading (``megarl.run.prelaunch``)."""

    def resolve_locations(self, config: Any, folders: Callable[[str], list[Path]]) -> None:
        """Turn names into paths every process finds; ``folders(key)``: the folder of the file that set ``key``."""

    def check(self, config: Any) -> None:
        """Raise :class:`ConfigError` for what the config names and cannot be used."""


def load_config_values(
    argv: list[str], config_cls: type[T], prelaunch: PrelaunchHooks | None = None
) -> tuple[T, list[str]]:
    """Parse ``--config FILE`` (repeatable) and ``key=value`` overrides from ``argv``.

    Returns the typed config, its values checked, and the arguments that were neither (for the
    caller's own parser). Raises :class:`ConfigError` naming the key and value at fault.
    ``prelaunch``: see :func:`build_config_values`; ``megarl.run.prelaunch.load_expr_config`` is this
    function with the pre-launch checks.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", action="append", default=[], help="YAML config file (repeatable)")
    known, rest = parser.parse_known_args(argv)
    overrides = [arg for arg in rest if "=" in arg and not arg.startswith("-")]
    rest = [arg for arg in rest if arg not in overrides]
    return build_config_values(config_cls, known.config, overrides, prelaunch), rest


def build_config_values(
    config_cls: type[T], files: list[str], overrides: list[str], prelaunch: PrelaunchHooks | None = None
) -> T:
    """Merge defaults, YAML ``files`` and dotlist ``overrides`` into a validated ``config_cls``.

    ``prelaunch``: hooks that resolve and check what the config names (``megarl.run.prelaunch``);
    without them nothing outside the config is read.

    A config class with ``preset_layers(merged)`` (e.g. GRPOConfig: the settings ``actor.loss:
    dapo`` implies) gets those layers between its defaults and the user's files: a preset
    fills in what the user did not set.
    """
    schema = _schema(config_cls)
    layers = [(f"config file {path}", _load_yaml(path)) for path in files]
    if overrides:
        layers.append(("command-line overrides", _dotlist(overrides)))
    layers = [(source, _rename_areal_keys(layer, schema, source)) for source, layer in layers]
    merged = _merge_layers(schema, layers)
    preset_layers = getattr(config_cls, "preset_layers", None)
    presets = preset_layers(merged) if preset_layers is not None else []
    if presets:
        merged = _merge_layers(schema, [(source, OmegaConf.create(layer)) for source, layer in presets] + layers)
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _config_error(err, "the merged config") from None
    if prelaunch is not None:  # plug-in files and hub model ids -> absolute paths
        prelaunch.resolve_locations(config, functools.partial(_folders_setting, files, layers))
    try:
        validate_tree(config)
        if prelaunch is not None:
            prelaunch.check(config)
        resolve_auto = getattr(config, "resolve_auto", None)
        if resolve_auto is not None:  # e.g. GRPOConfig: ``dtype: auto`` -> this machine's dtype
            resolve_auto()
    except ConfigError as err:
        raise _naming_sources(err, config, layers) from None
    return config


@functools.cache
def _schema(config_cls: type) -> DictConfig:
    """The defaults of ``config_cls`` as a structured config, built once per class (a fifth of a second
    for GRPOConfig, which a process loading many configs would otherwise pay each time). Shared: read
    it, merge onto it (``OmegaConf.merge`` copies its first config), never change it."""
    return OmegaConf.structured(config_cls)


LAYOUT_KEYS = ("allocation_mode", "cluster.n_nodes", "cluster.n_gpus_per_node")
"""The allocation and the cluster it is checked against: a parallel-strategy preset sets all three."""


def _naming_sources(err: ConfigError, config, layers: list[tuple[str, Any]]) -> ConfigError:
    """``err`` saying which layer set each key it weighed, when several layers were merged.

    E.g. an experiment file and a parallel preset after it: a batch size that does not split
    over the preset's data-parallel ranks names both files, and an allocation error names the
    file of the allocation and of the cluster size (:data:`LAYOUT_KEYS`) with their values.
    """
    if len(layers) < 2:
        return err
    keys = [err.key, *err.related]
    if "allocation_mode" in keys:
        keys += LAYOUT_KEYS
    by_source: dict[str, list[str]] = {}
    for key in dict.fromkeys(keys):
        source = next((src for src, layer in reversed(layers) if _get(_container(layer), key)[0]), None)
        if source is not None:
            by_source.setdefault(source, []).append(f"{key}={_value_at(config, key)!r}")
    if not by_source:
        return err
    said = "; ".join(f"{source}: {', '.join(values)}" for source, values in by_source.items())
    return ConfigError(err.key, f"{err.message} (set in {said})", err.related)


def _value_at(config, dotted: str) -> Any:
    """The value of ``config`` (dataclasses, dicts within) at the key ``dotted``; None where it has none."""
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else getattr(config, part, None)
    return config


def _container(layer) -> dict:
    return OmegaConf.to_container(layer, resolve=False) if isinstance(layer, DictConfig) else {}


def _folders_setting(files: list[str], layers: list, key: str) -> list[Path]:
    """``[folder]`` of the last config file that sets ``key``; ``[]`` when the command line
    sets it (its relative paths start from the working directory) or nothing does."""
    for index in reversed(range(len(layers))):
        if _get(OmegaConf.to_container(layers[index][1], resolve=False), key)[0]:
            return [Path(files[index]).resolve().parent] if index < len(files) else []
    return []


def _merge_layers(schema, layers: list[tuple[str, Any]]):
    merged = schema
    for source, layer in layers:
        merged = _merge(merged, layer, source)
    return merged


def _load_yaml(path: str):
    file = Path(path)
    if file.is_dir():
        raise ConfigError("", f"config file {path!r} is a directory; expected a YAML file")
    if not file.is_file():
        raise ConfigError("", f"config file {path!r} does not exist")
    try:
        loaded = OmegaConf.load(file)
    except Exception as err:  # yaml.YAMLError and friends: report the file
        raise ConfigError("", f"config file {path!r} is not valid YAML: {err}") from None
    if not OmegaConf.is_dict(loaded):
        raise ConfigError("", f"config file {path!r} must hold a mapping of keys, got {type(loaded).__name__}")
    return loaded


def _dotlist(overrides: list[str]):
    layers = []
    for arg in overrides:
        arg = arg.removeprefix("++").removeprefix("+")  # Hydra's "add the key" (AReaL's commands use it)
        key = arg.split("=", 1)[0]
        if not key or key.startswith(".") or key.endswith(".") or ".." in key:
            raise ConfigError(key, f"override {arg!r} is not of the form key.path=value")
        try:
            layers.append(OmegaConf.from_dotlist([arg]))
        except Exception as err:  # the value is parsed as YAML: report which override broke
            message = str(err).replace("\n", " ")
            raise ConfigError(key, f"cannot parse the value of override {arg!r}: {message}") from None
    return OmegaConf.merge(*layers)


def _rename_areal_keys(layer, schema, source: str):
    """``layer`` with each AReaL key of :data:`AREAL_ALIASES` renamed to its megarl key.

    Only where ``schema`` (the config class) has the megarl key and not the AReaL one.
    """
    data = OmegaConf.to_container(layer, resolve=False)  # interpolations stay "${...}" strings
    renamed = False
    for areal_key, megarl_key in AREAL_ALIASES.items():
        if _has_key(schema, areal_key) or not _has_key(schema, megarl_key):
            continue
        found, value = _pop(data, areal_key)
        if not found:
            continue
        renamed = True
        logger.info("AReaL key %s is megarl's %s (in %s)", areal_key, megarl_key, source)
        if value == "${" + megarl_key + "}":
            continue  # AReaL's `fileroot: ${cluster.fileroot}`: says nothing new
        has_target, target = _get(data, megarl_key)
        if has_target and target != value:
            raise ConfigError(
                areal_key,
                f"AReaL key {areal_key}={value!r} contradicts {megarl_key}={target!r} in {source}: "
                f"keep {megarl_key} only",
            )
        _set(data, megarl_key, value)
    return OmegaConf.create(data) if renamed else layer


def _has_key(schema, dotted: str) -> bool:
    """Whether the structured config ``schema`` has the key ``dotted`` (required ones included)."""
    *parents, leaf = dotted.split(".")
    node = schema
    for part in parents:
        if not OmegaConf.is_dict(node) or part not in node:
            return False
        node = node[part]
    return OmegaConf.is_dict(node) and leaf in node.keys()


def _get(data: dict, dotted: str) -> tuple[bool, Any]:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data.get(part)
        if not isinstance(data, dict):
            return False, None
    return (leaf in data), data.get(leaf)


def _pop(data: dict, dotted: str) -> tuple[bool, Any]:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data.get(part)
        if not isinstance(data, dict):
            return False, None
    return (True, data.pop(leaf)) if leaf in data else (False, None)


def _set(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[leaf] = value


def _merge(base, layer, source: str):
    try:
        return OmegaConf.merge(base, layer)
    except (OmegaConfBaseException, TypeError) as err:  # TypeError: a list merged into a mapping
        named = getattr(err, "full_key", None)
        key = named or _failing_key(base, layer)
        expected = _expected(base, key) if key else None
        if named and expected == "a single value":  # a block that is null in ``base``: OmegaConf's words say
            expected = _shape_in(err) or expected
        if named and OmegaConf.select(layer, key, default="") is None:  # `key=`, or `key:` with nothing after it
            raise _empty_value(base, key, source) from None
        if key is None or (named and expected == "a single value"):
            # OmegaConf's own words name a scalar's value ("Value 'abc' of type 'str' could not be converted
            # to Integer"); a list or a mapping given the wrong shape gets ours, which names the value
            raise _config_error(err, source) from None
        value = OmegaConf.select(layer, key, default=None)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=False)
        raise ConfigError(key, f"{value!r} is invalid: expected {expected} (in {source})") from None


def _empty_value(base, key: str, source: str) -> ConfigError:
    """``key`` given no value (null), which it does not take: say so, and what it takes."""
    current = OmegaConf.select(base, key, default=None)
    kind = f" of type {type(current).__name__}" if current is not None else ""
    return ConfigError(key, f"the value is empty (null); expected a value{kind} (in {source})")


def _failing_key(base, layer, prefix: str = "") -> str | None:
    """The dotted key of ``layer`` whose value ``base`` cannot take (OmegaConf does not always say)."""
    for name, value in layer.items_ex(resolve=False) if isinstance(layer, DictConfig) else []:
        key = f"{prefix}.{name}" if prefix else str(name)
        try:
            OmegaConf.merge(base, _nested(key, value))
        except (OmegaConfBaseException, TypeError):
            target = OmegaConf.select(base, key, default=None)
            deeper = (
                _failing_key(base, value, key)
                if isinstance(value, DictConfig) and isinstance(target, DictConfig)
                else None
            )
            return deeper or key
    return None


def _nested(dotted: str, value):
    """``{a: {b: value}}`` for ``a.b``."""
    tree = value
    for part in reversed(dotted.split(".")):
        tree = {part: tree}
    return OmegaConf.create(tree)


def _shape_in(err: Exception) -> str | None:
    """The list or mapping an OmegaConf type error says a key wanted, in words; None for a scalar."""
    message = str(err)
    if "is not a ListConfig" in message:
        return "a list"
    if message.startswith("Cannot assign") and " to Dict[" in message:
        return "a mapping of names to values"
    return None


def _expected(base, key: str) -> str:
    """What ``base`` holds at ``key``, in words (a config block, a mapping, a list, or a value)."""
    node = OmegaConf.select(base, key, default=None)
    if isinstance(node, DictConfig):
        kind = OmegaConf.get_type(node)
        if kind is not None and kind is not dict:
            return f"a {kind.__name__} block (a mapping of its keys, e.g. {key}.{next(iter(node.keys()), 'key')}=...)"
        return "a mapping of names to values"
    if isinstance(node, ListConfig):
        return "a list"
    return "a single value"


def _config_error(err: Exception, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    message = str(err).split("\n", 1)[0]
    return ConfigError(str(key), f"{message} (in {source})")


def to_yaml(config) -> str:
    """The config as YAML; loading it back gives an equal config."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def save_config(config, path: str | Path | None = None) -> Path:
    """Write the resolved config next to the run's outputs (``{run_dir}/config.yaml`` by default)."""
    target = Path(path) if path is not None else Path(config.run_dir) / "config.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(to_yaml(config))
    tmp.replace(target)
    return target


RENAMED = {"load_expr_config": "load_config_values", "build_config": "build_config_values"}
"""Old names of this module's loaders -> their names now (the old ones said nothing of the difference
from ``megarl.run.prelaunch``'s, which also check what the config names)."""


def renamed_loader(name: str, stacklevel: int = 3) -> Callable[..., Any]:
    """The loader an old name (:data:`RENAMED`) stands for, with a :class:`DeprecationWarning` saying
    its name now; ``stacklevel``: the caller's frame, as for :func:`warnings.warn`."""
    new = RENAMED[name]
    warnings.warn(
        f"megarl.config.{name} is now megarl.config.{new} (the config's values checked, nothing it names read); "
        f"megarl.run.prelaunch.{name} also checks what the config names, as a run does",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return globals()[new]


def __getattr__(name: str) -> Any:
    if name in RENAMED:
        return renamed_loader(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
