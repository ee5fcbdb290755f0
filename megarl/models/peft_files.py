"""The files of a PEFT adapter directory (what ``MegatronEngine.export_adapters`` writes and
``actor.lora.init_from`` reads), named without importing Megatron-Core: the config checks look for them."""

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
