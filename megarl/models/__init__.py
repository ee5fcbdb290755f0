"""Models: provisioning (short names → HF dirs), tiny test models, HF <-> Megatron mappings.

The names below load on first use, so that a torch-free module of the package
(:mod:`megarl.models.names`, ``provision``, ``upcycle``) imports without torch.
``megarl.models.build``, ``hf_io``, ``spec`` and ``layers`` load Megatron-Core and are imported
directly.
"""

import importlib

_HOMES = {
    "MODEL_FAMILIES": "families",
    "Family": "families",
    "family_of": "families",
    "FamilyMapping": "mapping",
    "ModelDims": "mapping",
    "ParamRule": "mapping",
    "export_from_shards": "mapping",
    "load_shard": "mapping",
    "KNOWN_MODELS": "provision",
    "default_cache_dir": "provision",
    "resolve_model_path": "provision",
    "TINY_FAMILIES": "tiny",
    "make_tiny_model": "tiny",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'megarl.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megarl.models.{_HOMES[name]}"), name)
