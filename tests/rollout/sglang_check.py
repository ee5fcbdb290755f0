"""Validate megarl's SGLang payloads and launch command with SGLang's own classes (a subprocess).

``sglang.srt.managers.io_struct`` imports ``torchvision`` transitively (multimodal
utilities) although request parsing never uses it; the torchvision on PyPI is a CUDA
build that breaks this CPU torch, so it is not installed. This script runs in its own
process and gives ``torchvision`` an inert stand-in, so nothing else is affected.

Reads JSON ``{"generate": [...], "score": [...], "pause": {...}, "resume": {...}, "launch_args": [...]}``
on stdin; prints ``{"ok": true}`` or the first error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.sglang_stub import prepare_sglang  # noqa: E402


def main() -> None:
    request = json.load(sys.stdin)
    prepare_sglang()
    from pydantic import TypeAdapter
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import (
        ContinueGenerationReqInput,
        GenerateReqInput,
        PauseGenerationReqInput,
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
    )
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    known = {f.name for f in dataclasses.fields(GenerateReqInput)}
    # what SGLang fills, for a request that leaves it out, from a model's generation_config.json
    # (--sampling-defaults model, its default): a file that sets every field it can
    from sglang.srt.configs.model_config import ModelConfig
    from transformers import GenerationConfig

    every = GenerationConfig(repetition_penalty=1.5, temperature=0.5, top_k=3, top_p=0.5, min_p=0.2)
    model_defaults = ModelConfig.get_default_sampling_params(
        SimpleNamespace(sampling_defaults="model", hf_generation_config=every)
    )
    assert model_defaults, "SGLang's model defaults are read another way now: update this check"
    for payload in request["generate"]:
        unknown = set(payload) - known
        assert not unknown, f"fields GenerateReqInput does not have: {sorted(unknown)}"
        error = generate_contract_error(payload)  # the /generate route's schema gate
        assert error is None, error
        obj = TypeAdapter(GenerateReqInput).validate_python(payload)  # what FastAPI does with the body
        obj.normalize_batch_and_arguments()
        assert obj.input_ids == payload["input_ids"] and obj.return_logprob is True, obj
        if "lora_path" in payload:  # a loaded adapter, by name
            assert obj.lora_path == payload["lora_path"], obj
        if payload.get("return_routed_experts"):
            assert obj.return_routed_experts is True, obj
            assert obj.routed_experts_start_len == payload["routed_experts_start_len"], obj
        SamplingParams(**payload["sampling_params"]).verify(vocab_size=request["vocab_size"])
        missing = set(model_defaults) - set(payload["sampling_params"])
        assert not missing, f"sampling fields SGLang would take from generation_config.json: {sorted(missing)}"
    for payload in request.get("score", []):  # a teacher's logprobs of a given sequence (on-policy distillation)
        unknown = set(payload) - known
        assert not unknown, f"fields GenerateReqInput does not have: {sorted(unknown)}"
        error = generate_contract_error(payload)
        assert error is None, error
        obj = TypeAdapter(GenerateReqInput).validate_python(payload)
        obj.normalize_batch_and_arguments()
        assert obj.return_logprob is True and obj.logprob_start_len == 0, obj
        assert obj.input_ids == payload.get("input_ids") and obj.text == payload.get("text"), obj
        SamplingParams(**payload["sampling_params"]).verify(vocab_size=request["vocab_size"])
    pause = TypeAdapter(PauseGenerationReqInput).validate_python(request["pause"])
    assert pause.mode == "abort", pause
    TypeAdapter(ContinueGenerationReqInput).validate_python(request["resume"])
    for key, model in (("release", ReleaseMemoryOccupationReqInput), ("resume_memory", ResumeMemoryOccupationReqInput)):
        if key in request:  # colocated placement: every region (weights and KV cache) when tags is None
            assert TypeAdapter(model).validate_python(request[key]).tags is None, request[key]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(request["launch_args"])
    print(
        json.dumps(
            {
                "ok": True,
                "model_path": args.model_path,
                "tp_size": args.tp_size,
                "port": args.port,
                "routed_experts": args.enable_return_routed_experts,
                "memory_saver": args.enable_memory_saver,
                "lora": [args.enable_lora, args.max_lora_rank, args.lora_target_modules, args.max_loras_per_batch]
                + [args.max_loaded_loras],
            }
        )
    )


if __name__ == "__main__":
    main()
