"""The safetensors files of an HF model directory, and what makes them unloadable, read from their headers.

A safetensors file starts with an 8-byte little-endian header length, then a JSON header giving each
tensor's dtype, shape and byte range in the data that follows. Reading the headers alone (kilobytes for a
model of any size) finds what would otherwise fail minutes into a run, after the servers started: a shard
the index names that is missing, a file cut short by an interrupted copy, weights of another size than
``config.json`` says.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
EMBEDDING = "model.embed_tokens.weight"
"""The input embedding's name in every supported family: ``[vocab_size, hidden_size]``."""


def weight_files(hf_dir: str | Path) -> list[str]:
    """The safetensors files of ``hf_dir``: those its index names, else ``model.safetensors``."""
    index = Path(hf_dir) / INDEX_NAME
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [WEIGHTS_NAME]


def read_header(path: Path) -> tuple[int, dict]:
    """The header of the safetensors file ``path``: its length in bytes and its JSON (``ValueError`` when
    the file has none)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} has {len(head)} bytes: not a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > path.stat().st_size - 8:
            raise ValueError(f"{path.name} is not a safetensors file (or its header was cut short)")
        return length, json.loads(f.read(length))


def _file_problem(path: Path, hidden_size: int | None) -> str | None:
    try:
        length, header = read_header(path)
    except (OSError, ValueError) as err:  # json's errors are ValueErrors
        return str(err)
    try:
        header.pop("__metadata__", None)
        placed = max((int(tensor["data_offsets"][1]) for tensor in header.values()), default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        return f"{path.name} is not a safetensors file (its header does not place its tensors)"
    held = path.stat().st_size - 8 - length
    if held < placed:
        return f"{path.name} is cut short: its header places {placed:,} bytes of tensors, it holds {held:,}"
    shape = header.get(EMBEDDING, {}).get("shape")
    if hidden_size and shape and len(shape) == 2 and shape[1] != hidden_size:
        return f"{path.name}: {EMBEDDING} is {shape}, but config.json says hidden_size={hidden_size}"
    return None


def weights_problem(hf_dir: str | Path) -> str | None:
    """Why the weights of the HF model directory ``hf_dir`` cannot be loaded, or None: a missing or
    unreadable index, a file it names (or ``model.safetensors``) missing, a file cut short or not
    safetensors, an embedding whose width is not ``config.json``'s ``hidden_size``."""
    hf_dir = Path(hf_dir)
    try:
        files = weight_files(hf_dir)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{INDEX_NAME} is unreadable ({type(err).__name__}: {err})"
    missing = [name for name in files if not (hf_dir / name).is_file()]
    if missing and files == [WEIGHTS_NAME]:
        return f"no weights: neither {WEIGHTS_NAME} nor {INDEX_NAME} is in the directory"
    if missing:
        return (
            f"{INDEX_NAME} names {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}, "
            f"not in the directory ({len(files) - len(missing)} of {len(files)} files present)"
        )
    try:
        hidden_size = json.loads((hf_dir / "config.json").read_text()).get("hidden_size")
    except (OSError, ValueError):
        hidden_size = None  # config.json's own check names it
    return next((p for p in (_file_problem(hf_dir / name, hidden_size) for name in files) if p), None)
