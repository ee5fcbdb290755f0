"""The model short names megarl knows without a hub, and the shapes a config is checked against.

One table for every reader: the pre-launch checks and the planner read a short name's shape here
before anything is provisioned or loaded, and :mod:`megarl.models.provision` makes the files behind
each name. This module imports no torch (``import megarl.models.names`` is quick).
"""

from __future__ import annotations

import types

from megarl.models.upcycle import SMOLLM2_MOE

_SMOLLM2_135M = {"num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152}

MODEL_SHAPES = types.MappingProxyType(
    {
        "smollm2-135m-instruct": types.MappingProxyType(_SMOLLM2_135M),
        "smollm2-135m-moe": types.MappingProxyType({**_SMOLLM2_135M, "num_experts": SMOLLM2_MOE.num_experts}),
    }
)
"""Each known model's sizes that constrain a parallel layout (``config.json`` keys); the names are
those of :data:`megarl.models.provision.KNOWN_MODELS`."""
ALIASES = types.MappingProxyType({"smollm2": "smollm2-135m-instruct"})
"""Other names of a known model."""


def known_name(name: str) -> str | None:
    """The known model ``name`` means (case-insensitive, an alias resolved), or None for any other name."""
    name = name.lower()
    name = ALIASES.get(name, name)
    return name if name in MODEL_SHAPES else None


def short_names() -> list[str]:
    """Every short name, aliases included, sorted (for messages)."""
    return sorted([*MODEL_SHAPES, *ALIASES])
