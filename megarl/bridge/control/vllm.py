"""Driving a vLLM server (0.32, ``VLLM_SERVER_DEV_MODE=1``) that runs megarl's weight-transfer engine.

Routes (``vllm/entrypoints/rl/online/api_router.py``): ``/init_weight_transfer_engine``
``{"init_info"}``, ``/start_weight_update``, ``/update_weights`` ``{"update_info"}``,
``/finish_weight_update`` ``{"weight_version"}``; LoRA adapters (adapter weight sync, servers
started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):
``/v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}`` and
``/v1/unload_lora_adapter`` ``{"lora_name"}`` (``vllm/entrypoints/serve/lora/protocol.py``), both
answering in plain text; requests name the adapter as their ``model``. The server needs
``--weight-transfer-config '{"backend": "megarl"}'`` (``vllm_launch_spec`` always adds it)
and the megarl plugin (the ``vllm.general_plugins`` entry point, see :mod:`megarl.bridge.receivers.vllm`).
"""

from __future__ import annotations

from megarl.bridge.control.base import ServerControl, ServerControlError, http_json


class VLLMControl(ServerControl):
    """A vLLM server with megarl's weight-transfer engine."""

    name = "vllm"

    def __init__(self, address: str, tp: int, timeout: float = 600.0):
        super().__init__(address, tp, timeout)
        self._model: str | None = None

    def init_group(self, init_info: dict) -> None:
        http_json(self.address, "/init_weight_transfer_engine", {"init_info": init_info}, self.timeout)

    def begin(self, mode: str) -> None:
        http_json(self.address, "/start_weight_update", None, self.timeout)

    def receive(self, mode: str, path: str | None = None) -> None:
        http_json(self.address, "/update_weights", {"update_info": {"mode": mode, "path": path}}, self.timeout)

    def commit(self, version: int) -> None:
        http_json(self.address, "/finish_weight_update", {"weight_version": str(version)}, self.timeout)

    def load_adapter(self, name: str, path: str) -> None:
        # load_inplace: a server that holds ``name`` already (the same version pushed again) replaces it
        body = self.adapter_payload(name, path)
        http_json(self.address, "/v1/load_lora_adapter", body, self.timeout, text=True)
        self.adapter = name

    def unload_adapter(self, name: str) -> None:
        http_json(self.address, "/v1/unload_lora_adapter", {"lora_name": name}, self.timeout, text=True)

    @staticmethod
    def adapter_payload(name: str, path: str) -> dict:
        """The ``/v1/load_lora_adapter`` body (``LoadLoRAAdapterRequest``)."""
        return {"lora_name": name, "lora_path": path, "load_inplace": True}

    def model(self) -> str:
        """The model requests name: the served LoRA adapter, else the server's (base) model."""
        if self.adapter is not None:
            return self.adapter
        if self._model is None:
            reply = http_json(self.address, "/v1/models", method="GET", timeout=30)
            self._model = reply["data"][0]["id"]
        return self._model

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        out = []
        for seq in sequences:
            entries = self._prompt_logprobs(seq, 0)
            try:
                out.append([float(entry[str(tok)]["logprob"]) for entry, tok in zip(entries, seq[1:])])
            except (KeyError, IndexError, TypeError) as e:
                raise ServerControlError(
                    self.address, "/v1/completions", f"no prompt_logprobs in reply ({e})"
                ) from None
        return out

    def score_topk(self, sequences: list[list[int]], k: int) -> list[list[dict[int, float]]]:
        """``prompt_logprobs: k``: vLLM returns the top k (and the prompt's own token) per position, raw
        (prompt tokens skip the sampler's processing whatever ``--logprobs-mode`` says)."""
        out = []
        for seq in sequences:
            try:
                positions = []
                for entry in self._prompt_logprobs(seq, k):
                    top = sorted(entry.items(), key=lambda kv: kv[1]["rank"])[:k]
                    positions.append({int(tok): float(v["logprob"]) for tok, v in top})
            except (KeyError, ValueError, AttributeError, TypeError) as e:
                raise ServerControlError(self.address, "/v1/completions", f"malformed prompt_logprobs ({e})") from None
            out.append(positions)
        return out

    def _prompt_logprobs(self, seq: list[int], k: int) -> list:
        """The reply's ``prompt_logprobs`` of ``seq`` past its first token (``k`` top logprobs each)."""
        payload = {
            "model": self.model(),
            "prompt": list(seq),
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": k,
        }
        reply = http_json(self.address, "/v1/completions", payload, self.timeout)
        try:
            return reply["choices"][0]["prompt_logprobs"][1:]
        except (KeyError, IndexError, TypeError) as e:
            raise ServerControlError(self.address, "/v1/completions", f"no prompt_logprobs in reply ({e})") from None

    def generate(self, prompt: list[int], max_tokens: int, seed: int) -> list[int]:
        """Sample ``max_tokens`` after ``prompt`` (the consistency probe's trajectories)."""
        payload = {
            "model": self.model(),
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed,
            "return_token_ids": True,
        }
        reply = http_json(self.address, "/v1/completions", payload, self.timeout)
        return list(prompt) + [int(t) for t in reply["choices"][0]["token_ids"]]
