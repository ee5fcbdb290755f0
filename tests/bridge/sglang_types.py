"""SGLang's own request classes for the weight-update routes (import in a subprocess only).

``sglang.srt.managers.io_struct`` imports ``torchvision`` transitively although request
parsing never uses it; the CUDA torchvision on PyPI breaks this CPU torch, so an inert
stand-in is installed first (as ``tests/rollout/sglang_check.py`` does). Importing
SGLang takes ~15 s: only the fake SGLang server and the contract-check script do it.
"""

from __future__ import annotations

from tests.sglang_stub import prepare_sglang

ROUTES = {
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/generate": "GenerateReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}


def import_sglang():
    """(io_struct module, init_custom_process_group, FlattenedTensorBucket) of the installed SGLang."""
    prepare_sglang()
    from sglang.srt.managers import io_struct
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return io_struct, init_custom_process_group, FlattenedTensorBucket


def validate(route: str, payload: dict):
    """The payload parsed by the route's SGLang request class; ValueError on unknown fields or bad types."""
    from pydantic import TypeAdapter

    io_struct, _, _ = import_sglang()
    cls = getattr(io_struct, ROUTES[route])
    import dataclasses

    known = cls.__struct_fields__ if hasattr(cls, "__struct_fields__") else [f.name for f in dataclasses.fields(cls)]
    unknown = set(payload) - set(known)
    if unknown:
        raise ValueError(f"{route}: fields {cls.__name__} does not have: {sorted(unknown)}")
    return TypeAdapter(cls).validate_python(payload)  # what the FastAPI route does with the body
