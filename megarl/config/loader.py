"""Load an experiment config from YAML files plus ``key=value`` overrides.

    config, rest = load_expr_config(["--config", "configs/gsm8k_grpo_cpu.yaml", "actor.optimizer.lr=2e-6"], GRPOConfig)

Layers, later winning: the dataclass defaults, each ``--config`` file in order (so a
parallel-strategy preset can follow an experiment file), then the overrides. The
merge is an OmegaConf structured config, so a misspelled key or a value of the
wrong type fails with its full key path; then every config's ``check()`` runs, and the
experiment's ``resolve_auto()`` (if it has one) makes machine-dependent values concrete.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.base import ConfigError, validate_tree

T = TypeVar("T")


def load_expr_config(argv: list[str], config_cls: type[T]) -> tuple[T, list[str]]:
    """Parse ``--config FILE`` (repeatable) and ``key=value`` overrides from ``argv``.

    Returns the typed, validated config and the arguments that were neither (for the
    caller's own parser). Raises :class:`ConfigError` naming the key and value at fault.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", action="append", default=[], help="YAML config file (repeatable)")
    known, rest = parser.parse_known_args(argv)
    overrides = [arg for arg in rest if "=" in arg and not arg.startswith("-")]
    rest = [arg for arg in rest if arg not in overrides]
    return build_config(config_cls, known.config, overrides), rest


def build_config(config_cls: type[T], files: list[str], overrides: list[str]) -> T:
    """Merge defaults, YAML ``files`` and dotlist ``overrides`` into a validated ``config_cls``."""
    merged = OmegaConf.structured(config_cls)
    for path in files:
        merged = _merge(merged, _load_yaml(path), source=f"config file {path}")
    if overrides:
        merged = _merge(merged, _dotlist(overrides), source="command-line overrides")
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _config_error(err, "the merged config") from None
    validate_tree(config)
    resolve_auto = getattr(config, "resolve_auto", None)
    if resolve_auto is not None:  # e.g. GRPOConfig: ``dtype: auto`` -> this machine's dtype
        resolve_auto()
    return config


def _load_yaml(path: str):
    file = Path(path)
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
        key = arg.split("=", 1)[0]
        if not key or key.startswith(".") or key.endswith(".") or ".." in key:
            raise ConfigError(key, f"override {arg!r} is not of the form key.path=value")
        try:
            layers.append(OmegaConf.from_dotlist([arg]))
        except Exception as err:  # the value is parsed as YAML: report which override broke
            message = str(err).replace("\n", " ")
            raise ConfigError(key, f"cannot parse the value of override {arg!r}: {message}") from None
    return OmegaConf.merge(*layers)


def _merge(base, layer, source: str):
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as err:
        raise _config_error(err, source) from None


def _config_error(err: OmegaConfBaseException, source: str) -> ConfigError:
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
