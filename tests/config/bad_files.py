"""Files for the bad-config cases: a minimal good HF ``config.json``, and bad model configs and datasets."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MODEL_FIELDS = {  # a minimal config.json the checks accept (a llama of no particular size)
    "model_type": "llama",
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 1000,
}


def write_model_dir(path: Path, config: dict) -> Path:
    """A stand-in HF model directory the pre-launch checks accept: ``config`` as its ``config.json``, a
    ``model.safetensors`` that holds no tensor and a tokenizer file (the checks read headers and names)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    header = b"{}"
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    (path / "tokenizer.json").write_text("{}")
    return path


def write_bad_files(root: Path) -> str:
    """Bad model configs and dataset files in ``root``, for the cases of ``test_bad_configs`` that name ``@files``."""
    models = {
        "no_heads": {"num_hidden_layers": 4},
        "list": [1, 2],
        "gpt2": {**MODEL_FIELDS, "model_type": "gpt2"},
        "heads_str": {**MODEL_FIELDS, "num_attention_heads": "8"},
        "attention_bias": {**MODEL_FIELDS, "attention_bias": True},
        "qwen2_window": {**MODEL_FIELDS, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8},
    }
    for name, config in models.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    (root / "bad_json").mkdir()
    (root / "bad_json" / "config.json").write_text('{"num_attention_heads": 8,')
    chat = {"prompt": "1+1?", "answer": "2"}
    (root / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    (root / "broken.jsonl").write_text(json.dumps(chat) + '\n{"prompt": \n')
    (root / "lists.jsonl").write_text("[1, 2]\n")
    (root / "empty.jsonl").write_text("\n")
    (root / "dict.json").write_text(json.dumps({"rows": [chat]}))
    (root / "latin1.jsonl").write_bytes('{"question": "caf\u00e9", "answer": "#### 1"}\n'.encode("latin-1"))
    (root / "two_rows.jsonl").write_text(
        "".join(json.dumps({"question": "q", "answer": f"#### {i}"}) + "\n" for i in (1, 2))
    )
    pq.write_table(
        pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), root / "no_rows.parquet"
    )
    (root / "hub_layout" / "data").mkdir(parents=True)  # a hub snapshot's layout: one split, train
    pq.write_table(
        pa.table({"question": ["q"], "answer": ["#### 1"]}),
        root / "hub_layout" / "data" / "train-00000-of-00001.parquet",
    )
    (root / "no_data").mkdir()
    (root / "runs").mkdir()
    return str(root)
