"""A scripted inference engine for the agent-proxy tests: exact ids, no server."""

from __future__ import annotations

from megarl.api import ModelRequest, ModelResponse


class ScriptedLLM:
    """Answers call ``k`` (1-based) with ``replies[k-1]``, then ``"ok"`` (or with ``reply(request)``).

    A text reply is encoded and ended with the EOS token; an id list is sampled as given
    (no EOS added); an exception is raised. An output over the request's token budget is cut
    (``stop_reason="length"``). Logprobs ``-(k + i/1000)`` and version ``k`` tell every
    sampled token apart. ``tokenizer`` is there as on an initialized ``RemoteInferenceEngine``.
    """

    def __init__(self, tokenizer, replies=(), reply=None):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.reply = reply
        self.requests: list[ModelRequest] = []
        self.responses: list[ModelResponse] = []

    def get_version(self) -> int:
        return len(self.requests)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        k = len(self.requests)
        reply = self.reply(req) if self.reply else self.replies.pop(0) if self.replies else "ok"
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, str):
            reply = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        budget = req.gconfig.max_new_tokens
        ids = list(reply[:budget])
        resp = ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=ids,
            output_logprobs=[-(k + i / 1000) for i in range(len(ids))],
            output_versions=[k] * len(ids),
            stop_reason="length" if len(reply) > budget else "stop",
        )
        self.responses.append(resp)
        return resp
