"""Which KL reference a run builds (``megarl.run.components.build_ref``): none without the KL term, a LoRA
actor's own model with its initial adapters when no ``ref`` model is configured, a model otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megarl.config.train import LoRAConfig, TrainEngineConfig
from megarl.run import components


@pytest.fixture
def built(monkeypatch):
    """What build_ref built, by kind, instead of building it."""
    made = []

    class Engine:
        def __init__(self, config):
            made.append(("model", config))

        def initialize(self, parallel):
            pass

    monkeypatch.setattr(components, "MegatronEngine", Engine)
    monkeypatch.setattr(components, "AdapterReference", lambda actor: made.append(("actor", actor)) or "reference")
    return made


def _config(kl: float, rank: int, ref: TrainEngineConfig | None = None):
    actor = TrainEngineConfig(lora=LoRAConfig(rank=rank))
    actor.kl_ctl = kl
    return SimpleNamespace(actor=actor, ref=ref)


def test_no_kl_term_no_reference(built):
    assert components.build_ref(_config(0.0, 16), None, "the actor") is None and built == []


def test_a_lora_actor_is_its_own_reference(built):
    """No second copy of the base weights: the actor's model, its adapters set back for the pass."""
    assert components.build_ref(_config(0.1, 16), None, "the actor") == "reference"
    assert built == [("actor", "the actor")]


@pytest.mark.parametrize("rank, ref", [(0, None), (16, TrainEngineConfig(path="other-model"))])
def test_a_model_otherwise(built, rank, ref):
    """Full fine-tuning, or a reference model named in the config (with LoRA too), is a model of its own."""
    components.build_ref(_config(0.1, rank, ref), None, "the actor")
    assert [kind for kind, _ in built] == ["model"]
    assert ref is None or built[0][1] is ref
