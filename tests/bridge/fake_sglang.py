"""A fake SGLang server (one TP rank) that receives weights the way SGLang does.

Run as a script: ``python fake_sglang.py --port P``. Every body is parsed with SGLang's
own request class (``sglang_types.validate``); the group is joined with SGLang's own
``init_custom_process_group`` (rank ``rank_offset``) and each bucket is received into
SGLang's own ``FlattenedTensorBucket``, so a trainer that fills this server fills a real
one. Received tensors are kept by name; ``POST /fake/dump {"path"}`` saves them with
their weight version. LoRA adapters are loaded from their PEFT directory and kept by name
(``GET /fake/adapters``: each one's tensors, summed). Only what the bridge uses is implemented.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.bridge.sglang_types import import_sglang, validate

logger = logging.getLogger("fake_sglang")


class FakeSGLang:
    def __init__(self):
        _, self.init_group, self.bucket_cls = import_sglang()
        self.groups: dict[str, object] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.session = False
        self.version = None
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}  # LoRA adapter name -> its tensors

    def init_weights_update_group(self, req) -> dict:
        self.groups[req.group_name] = self.init_group(
            backend=req.backend,
            init_method=f"tcp://{req.master_address}:{req.master_port}",
            world_size=req.world_size,
            rank=req.rank_offset,
            group_name=req.group_name,
        )
        return {"success": True, "message": "joined"}

    def update_weights_from_distributed(self, req) -> dict:
        if not self.session:
            return {"success": False, "message": "update_weights_from_distributed must run between begin/end"}
        if req.load_format != "flattened_bucket":
            return {"success": False, "message": f"fake handles flattened_bucket only, got {req.load_format}"}
        bucket = self.bucket_cls.empty(req.names, req.dtypes, req.shapes, "cpu")
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=self.groups[req.group_name])
        self.weights.update({name: t.clone() for name, t in bucket.reconstruct_tensors()})
        return {"success": True, "message": "ok"}

    def update_weights_from_disk(self, req) -> dict:
        from safetensors.torch import load_file

        for file in Path(req.model_path).glob("*.safetensors"):
            self.weights.update(load_file(str(file)))
        self.version = req.weight_version
        return {"success": True, "message": "ok", "num_paused_requests": 0}

    def load_lora_adapter(self, req) -> dict:
        from safetensors.torch import load_file

        if req.lora_name in self.adapters:  # SGLang refuses a name it holds
            return {"success": False, "error_message": f"LoRA adapter {req.lora_name} is already loaded"}
        self.adapters[req.lora_name] = load_file(str(Path(req.lora_path) / "adapter_model.safetensors"))
        return {"success": True, "loaded_adapters": {n: n for n in self.adapters}}

    def unload_lora_adapter(self, req) -> dict:
        if self.adapters.pop(req.lora_name, None) is None:
            return {"success": False, "error_message": f"LoRA adapter {req.lora_name} is not loaded"}
        return {"success": True, "loaded_adapters": {n: n for n in self.adapters}}


async def _handle(server: FakeSGLang, route: str, request: web.Request) -> web.Response:
    payload = await request.json() if request.can_read_body else {}
    try:
        req = validate(route, payload)
    except Exception as e:  # noqa: BLE001 (a contract violation: answer 400 as SGLang would)
        return web.json_response({"error": str(e)}, status=400)
    loop = asyncio.get_running_loop()
    if route == "/begin_weight_update":
        server.session = True
        return web.json_response({"success": True, "message": "begun"})
    if route == "/end_weight_update":
        server.session = False
        return web.json_response({"success": True, "message": "ended"})
    if route == "/update_weight_version":
        server.version = req.new_version
        return web.json_response({})
    method = getattr(server, route.strip("/"))
    reply = await loop.run_in_executor(None, method, req)
    return web.json_response(reply, status=400 if reply.get("success") is False and "lora" in route else 200)


def make_app(server: FakeSGLang) -> web.Application:
    app = web.Application(client_max_size=2**30)
    app.router.add_get("/health", lambda r: web.json_response({}))
    app.router.add_route("*", "/flush_cache", lambda r: web.json_response({}))
    for route in (
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_disk",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    ):
        app.router.add_post(route, lambda r, route=route: _handle(server, route, r))

    async def dump(request):
        body = await request.json()
        torch.save({"weights": server.weights, "version": server.version}, body["path"])
        return web.json_response({"names": len(server.weights)})

    app.router.add_post("/fake/dump", dump)

    async def adapters(request):  # each loaded adapter's tensors, summed
        return web.json_response(
            {name: {k: float(t.double().sum()) for k, t in ts.items()} for name, ts in server.adapters.items()}
        )

    app.router.add_get("/fake/adapters", adapters)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    web.run_app(make_app(FakeSGLang()), host="127.0.0.1", port=args.port, print=lambda *a: None)


if __name__ == "__main__":
    main()
