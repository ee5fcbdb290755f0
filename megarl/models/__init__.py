"""Models: provisioning (short names → HF dirs), tiny test models, HF <-> Megatron mappings.

Only modules that do not import Megatron are re-exported here; ``megarl.models.build``,
``hf_io``, ``spec`` and ``layers`` load Megatron-Core and are imported directly.
"""

from megarl.models.families import MODEL_FAMILIES, Family, family_of
from megarl.models.mapping import FamilyMapping, ModelDims, ParamRule, export_from_shards, load_shard
from megarl.models.provision import KNOWN_MODELS, default_cache_dir, resolve_model_path
from megarl.models.tiny import TINY_FAMILIES, make_tiny_model

__all__ = [
    "MODEL_FAMILIES",
    "KNOWN_MODELS",
    "TINY_FAMILIES",
    "Family",
    "FamilyMapping",
    "ModelDims",
    "ParamRule",
    "default_cache_dir",
    "export_from_shards",
    "family_of",
    "load_shard",
    "make_tiny_model",
    "resolve_model_path",
]
