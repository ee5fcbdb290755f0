"""Every key of the config schema, tried with values outside its type and its documented range.

The schema (``GRPOConfig`` and every block under it) is walked field by field; each field gets the bad
values its type calls for: an unknown choice for a choice, a list for a scalar and a scalar for a list or
a mapping, text for a number or a flag, NaN for a real number, -1 for a number (and 0 for a count or a
size), 1.5 for a probability or a fraction, a missing file for a path that must exist. Each must stop
``megarl config`` with exit status 2 and one line naming the key and the value, before anything starts,
unless the field's own docstring documents that value (``-1: off``, ``<= 0 disables``, ``0: ...``): then
it must load.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path

import pytest

from megarl.config import GRPOConfig
from megarl.launcher.cli import main
from megarl.run.prelaunch import load_expr_config

REPO = Path(__file__).resolve().parents[2]
CPU_YAML = "configs/gsm8k_grpo_cpu.yaml"

SECTIONS = {
    "ref": ["ref.path=smollm2", "actor.kl_ctl=0.1"],
    "critic": ["algorithm.adv_estimator=gae", "critic={}", "gconfig.n_samples=1", "actor.group_size=1"],
    "eval_workflow": ["eval_workflow={}"],
    "teacher": ["teacher.addresses=[teacher-node:8000]"],
}
"""Blocks that are null in the CPU config, and the overrides that give them (their keys are tried there)."""
STAYS_NULL = {"ref.optimizer": "the reference model is frozen"}
"""Blocks that cannot be given at all (the loader refuses them whole)."""

PROBABILITY = re.compile(r"(^|_)(top_p|min_p|fraction|dropout|prob)($|_)")
COUNT = re.compile(r"(^|_)(n|num|max|min|size|count|len|length|tokens|steps|every|workers|seqs|freq)(_|$)")
MUST_EXIST = {"actor.path", "ref.path", "critic.path", "train_dataset.path", "valid_dataset.path"}
"""Paths read before anything starts (a model, a dataset): a missing one is refused."""


def _unwrap(annotation):
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0] if len(inner) == 1 else annotation
    return annotation


@functools.cache
def _docstrings(cls) -> dict[str, str]:
    """Each field's docstring (the string right after its annotation), the class's own and its bases'."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    docs[node.target.id] = str(after.value.value)
    return docs


def leaves(cls=GRPOConfig, prefix: str = "") -> list[tuple[str, object, str]]:
    """(dotted key, type, docstring) of every scalar, list or mapping field under ``cls``."""
    found = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key, kind = prefix + field.name, _unwrap(hints[field.name])
        if dataclasses.is_dataclass(kind):
            if key not in STAYS_NULL:
                found += leaves(kind, key + ".")
        else:
            found.append((key, kind, _docstrings(cls).get(field.name, "")))
    return found


def _documents(doc: str, value: str) -> bool:
    """Whether a docstring gives ``value`` a meaning (``-1: off``, ``<= 0 disables``, ``0: ...``)."""
    if float(value) < 0:
        return bool(re.search(r"(?<![\w.])-1(?![\w.])|<= ?0|negative too", doc))
    return bool(re.search(r"(?<![\w.-])0(?![\w.%])|<= ?0|>= ?0", doc))


def probes(key: str, kind, doc: str) -> list[tuple[str, bool]]:
    """(bad value, whether the docstring makes it a good one) for the field."""
    name = key.rsplit(".", 1)[-1]
    origin = typing.get_origin(kind)
    if origin is typing.Literal:
        return [("no_such_choice", False), ("[1]", False)]
    if origin in (list, tuple):
        return [("3", False)]
    if origin is dict:
        return [("3", False), ("[1]", False)]
    if kind is bool:
        return [("maybe", False), ("[1]", False)]
    if kind is int:
        values = [("-1", _documents(doc, "-1")), ("abc", False), ("[1]", False)]
        if COUNT.search(name):
            values.append(("0", _documents(doc, "0")))
        return values
    if kind is float:
        values = [("-1.0", _documents(doc, "-1.0")), ("nan", False), ("abc", False), ("[1]", False)]
        if PROBABILITY.search(name):
            values.append(("1.5", False))
        return values
    if kind is str:
        values = [("[1]", False)]
        if key in MUST_EXIST:
            values.append(("/no/such/place/anywhere", False))
        return values
    return []


def cases():
    for key, kind, doc in leaves():
        for value, documented in probes(key, kind, doc):
            yield pytest.param(key, value, documented, id=f"{key}={value}")


def _overrides(key: str, value: str) -> list[str]:
    section = SECTIONS.get(key.split(".", 1)[0], [])
    return ["--config", CPU_YAML, *section, f"{key}={value}"]


@pytest.fixture(autouse=True)
def in_repo_offline(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("key,value,documented", list(cases()))
def test_a_value_outside_the_key_is_refused_naming_both(key, value, documented, capsys):
    status = main(["config", *_overrides(key, value)])
    out, err = capsys.readouterr()
    if documented:
        assert status == 0, f"{key}={value} is documented as valid, yet: {err}"
        return
    assert status == 2, f"{key}={value} was accepted"
    assert out == "" and len(err.splitlines()) == 1, err
    named_key = f"'{key}'" in err or f"'{key.rsplit('.', 1)[-1]}'" in err
    shown = value.strip("[]") if value != "no_such_choice" else value
    assert named_key and shown in err, f"{key}={value}: {err.strip()}"


def test_the_walk_covers_every_field_of_the_schema():
    keys = {key for key, _, _ in leaves()}
    assert len(keys) > 250 and {"actor.optimizer.lr", "critic.mb_spec.n_mbs", "ref.lora.rank"} <= keys
    typed = {key for key, kind, doc in leaves() if probes(key, kind, doc)}
    assert keys - typed == set(), "every field gets at least one bad value"


def test_the_null_blocks_load_as_given():
    for section, overrides in SECTIONS.items():
        config, _ = load_expr_config(["--config", CPU_YAML, *overrides], GRPOConfig)
        assert getattr(config, section) is not None
