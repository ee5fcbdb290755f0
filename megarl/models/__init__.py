"""Models: provisioning (short names → HF dirs), tiny test models, HF <-> Megatron mappings."""

from megarl.models.provision import KNOWN_MODELS, default_cache_dir, resolve_model_path
from megarl.models.tiny import TINY_FAMILIES, make_tiny_model

__all__ = ["KNOWN_MODELS", "TINY_FAMILIES", "default_cache_dir", "make_tiny_model", "resolve_model_path"]
