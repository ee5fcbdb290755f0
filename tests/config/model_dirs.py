"""Fields of a minimal HF ``config.json`` the config checks accept (a llama of no particular size)."""

MODEL_FIELDS = {
    "model_type": "llama",
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 1000,
}
