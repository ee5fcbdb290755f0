"""Driving an SGLang server (0.5.23) through its native weight-update routes.

SGLang is its own receiver: its workers join a group with ``/init_weights_update_group``
(the trainer's sender at group rank 0, SGLang's TP ranks at ``rank_offset + tp_rank``)
and take in each bucket with ``/update_weights_from_distributed`` (``load_format:
"flattened_bucket"``: one uint8 buffer per bucket, tensors back to back) between
``/begin_weight_update`` and ``/end_weight_update``; ``/update_weights_from_disk`` loads an
HF directory. Payload field names are those of ``sglang.srt.managers.io_struct``
(``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``UpdateWeightFromDiskReqInput``, ``UpdateWeightVersionReqInput``, ...); the tests validate
them against those classes. LoRA adapters (adapter weight sync, servers started with
``--enable-lora``): ``/load_lora_adapter`` (``LoadLoRAAdapterReqInput``), ``/unload_lora_adapter``
(``UnloadLoRAAdapterReqInput``); a ``/generate`` request names its adapter in ``lora_path``.

Limits: SGLang has no route that receives pre-sharded slices over a group (its
``update_weights_from_tensor`` passes CUDA IPC handles on one machine), so sharded mode
is vLLM-only. SGLang loads each bucket as it arrives: a failure mid-transfer leaves the
server half-updated, and the bridge marks it unhealthy.
"""

from __future__ import annotations

from megarl.bridge.control.base import ServerControl, ServerControlError, http_json

DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def _check(address: str, route: str, reply) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise ServerControlError(address, route, str(reply.get("message") or reply.get("error_message")))


class SGLangControl(ServerControl):
    """An SGLang server; broadcast and disk modes."""

    name = "sglang"

    def __init__(self, address: str, tp: int, timeout: float = 600.0):
        super().__init__(address, tp, timeout)
        self._groups: list[str] = []
        self._buckets: list[list[list]] = []
        self._dtype = "bfloat16"
        self._disk: str | None = None

    # payloads (plain dicts, checked against SGLang's request classes by the tests)

    def init_payloads(self, init_info: dict) -> list[dict]:
        """One ``/init_weights_update_group`` body per broadcast sender group."""
        wiring, offset = init_info["wiring"], init_info["worker_offset"]
        return [
            {
                "master_address": g["host"],
                "master_port": g["port"],
                "rank_offset": 1 + offset,
                "world_size": g["world_size"],
                "group_name": g["name"],
                "backend": wiring["backend"],
            }
            for g in wiring["broadcast"]
        ]

    def bucket_payloads(self) -> list[dict]:
        """One ``/update_weights_from_distributed`` body per bucket, in schedule order."""
        out = []
        for group, buckets in zip(self._groups, self._buckets):
            for entries in buckets:
                out.append(
                    {
                        "names": [n for n, _ in entries],
                        "dtypes": [self._dtype] * len(entries),
                        "shapes": [list(s) for _, s in entries],
                        "group_name": group,
                        "flush_cache": False,
                        "load_format": "flattened_bucket",
                    }
                )
        return out

    # ServerControl

    def init_group(self, init_info: dict) -> None:
        modes = init_info["specs"]["0"]
        if "sharded" in modes:
            raise ValueError(f"SGLang server {self.address}: only broadcast and disk modes (no sharded receive API)")
        if "broadcast" not in modes:  # disk mode only: the server reads each version from the path, no group
            self._groups, self._buckets = [], []
            return
        spec = modes["broadcast"]
        self._groups = [g["name"] for g in init_info["wiring"]["broadcast"]]
        self._buckets, self._dtype = spec["buckets"], DTYPE_NAMES[init_info["dtype"]]
        for payload in self.init_payloads(init_info):
            _check(
                self.address,
                "/init_weights_update_group",
                http_json(self.address, "/init_weights_update_group", payload, self.timeout),
            )

    def begin(self, mode: str) -> None:
        if mode == "sharded":
            raise ValueError(f"SGLang server {self.address}: sharded mode is not supported (no sharded receive API)")
        self._disk = None
        if mode == "broadcast":
            _check(
                self.address, "/begin_weight_update", http_json(self.address, "/begin_weight_update", {}, self.timeout)
            )

    def receive(self, mode: str, path: str | None = None) -> None:
        if mode == "disk":
            self._disk = path
            return
        for payload in self.bucket_payloads():
            _check(
                self.address,
                "/update_weights_from_distributed",
                http_json(self.address, "/update_weights_from_distributed", payload, self.timeout),
            )

    def commit(self, version: int) -> None:
        if self._disk is not None:
            body = {"model_path": self._disk, "weight_version": str(version), "flush_cache": True}
            _check(
                self.address,
                "/update_weights_from_disk",
                http_json(self.address, "/update_weights_from_disk", body, self.timeout),
            )
            return
        _check(self.address, "/end_weight_update", http_json(self.address, "/end_weight_update", {}, self.timeout))
        body = {"new_version": str(version), "abort_all_requests": False}
        http_json(self.address, "/update_weight_version", body, self.timeout)
        http_json(self.address, "/flush_cache", None, self.timeout)

    def load_adapter(self, name: str, path: str) -> None:
        if self.adapter == name:  # the same version pushed again: SGLang refuses a name it holds
            try:
                self.unload_adapter(name)
            except ServerControlError:
                pass  # a restarted server holds none
        route = "/load_lora_adapter"
        _check(self.address, route, http_json(self.address, route, self.adapter_payload(name, path), self.timeout))
        self.adapter = name

    def unload_adapter(self, name: str) -> None:
        route = "/unload_lora_adapter"
        _check(self.address, route, http_json(self.address, route, {"lora_name": name}, self.timeout))

    @staticmethod
    def adapter_payload(name: str, path: str) -> dict:
        """The ``/load_lora_adapter`` body (``LoadLoRAAdapterReqInput``)."""
        return {"lora_name": name, "lora_path": path}

    def _with_adapter(self, body: dict) -> dict:
        """A ``/generate`` body asking for the served adapter (``lora_path`` takes a loaded adapter's name)."""
        return body if self.adapter is None else {**body, "lora_path": self.adapter}

    def score_payload(self, seq: list[int], k: int = 0) -> dict:
        """The ``/generate`` body that scores ``seq`` (``GenerateReqInput``): the logprob of each of its
        tokens, and with ``k`` > 0 the ``k`` most likely tokens at each position too."""
        body = {
            "input_ids": list(seq),
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        return self._with_adapter({**body, "top_logprobs_num": k} if k > 0 else body)

    def _input_logprobs(self, seq: list[int], field: str, k: int = 0) -> list:
        """``meta_info[field]`` of the reply scoring ``seq``, past its first token (which has none)."""
        reply = http_json(self.address, "/generate", self.score_payload(seq, k), self.timeout)
        try:
            entries = reply["meta_info"][field][1:]
        except (KeyError, IndexError, TypeError) as e:
            raise ServerControlError(self.address, "/generate", f"no {field} in reply ({e})") from None
        if len(entries) != len(seq) - 1:
            raise ServerControlError(
                self.address, "/generate", f"{field} has {len(entries)} positions for {len(seq) - 1} tokens"
            )
        return entries

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        out = []
        for seq in sequences:
            entries = self._input_logprobs(seq, "input_token_logprobs")
            try:  # each entry is (logprob, token_id, text or None)
                out.append([float(e[0]) for e in entries])
            except (IndexError, TypeError, ValueError) as e:
                raise ServerControlError(self.address, "/generate", f"malformed input_token_logprobs ({e})") from None
        return out

    def score_topk(self, sequences: list[list[int]], k: int) -> list[list[dict[int, float]]]:
        """``top_logprobs_num: k``: SGLang returns, per input position, its k most likely tokens as
        (logprob, token_id, text or None), most likely first (``TokenizerManager.add_logprob_to_meta_info``)."""
        out = []
        for seq in sequences:
            entries = self._input_logprobs(seq, "input_top_logprobs", k)
            try:
                out.append([{int(tok): float(logprob) for logprob, tok, _ in entry[:k]} for entry in entries])
            except (IndexError, TypeError, ValueError) as e:
                raise ServerControlError(self.address, "/generate", f"malformed input_top_logprobs ({e})") from None
        return out

    def generate(self, prompt: list[int], max_tokens: int, seed: int) -> list[int]:
        body = {
            "input_ids": list(prompt),
            "return_logprob": False,
            "sampling_params": {
                "max_new_tokens": max_tokens,
                "min_new_tokens": max_tokens,
                "temperature": 1.0,
                "sampling_seed": seed,
            },
        }
        reply = http_json(self.address, "/generate", self._with_adapter(body), self.timeout)
        return list(prompt) + [int(t) for t in reply["output_ids"]]
