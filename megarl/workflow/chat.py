"""Token in, token out: what the multi-turn workflows share.

A conversation is trained on exactly the tokens the server sampled, so a workflow never
decodes what the model wrote and encodes it again (that does not always give back the
same ids). The next turn's prompt is the previous prompt and output ids, an end-of-sequence
token if the output did not end with one, and the chat template's ids of the turns that
follow (:func:`next_turn_ids`). :class:`Episode` keeps the token-aligned lists of such a
conversation and turns it into a trajectory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megarl.api.trajectory import build_trajectory

# A conversation every chat template accepts; only its end-of-sequence tokens are counted.
_ANCHOR = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def render_chat_ids(
    tokenizer,
    messages: Sequence[dict[str, Any]],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """``messages`` (and ``tools``, for templates that render them) through the chat template, as ids;
    ``template_kwargs`` (e.g. ``enable_thinking``) are the template's variables."""
    ids = tokenizer.apply_chat_template(
        list(messages),
        tools=tools or None,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
        **template_kwargs,
    )
    return list(ids)


def next_turn_ids(
    tokenizer, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None, **template_kwargs: Any
) -> list[int]:
    """Ids the chat template puts after an assistant turn's end-of-sequence token, up to the next
    generation prompt: the rest of that turn (a ChatML newline), then ``messages``. The template
    renders with ``template_kwargs``: those of the conversation's first prompt (e.g. ``enable_thinking``,
    whose generation prompt differs on Qwen3), so that every turn is prompted alike.

    Appended to sampled ids that end with the EOS token, they give what the template renders
    for the whole conversation. Found as AReaL's ``concat`` mode finds them: an anchor
    conversation rendered alone has ``k`` EOS tokens; rendered followed by ``messages``, the
    ids after its ``k``-th EOS are the answer. (Comparing prefixes instead fails on templates
    that render the last assistant turn differently, e.g. Qwen3's empty think block.)
    """
    eos = tokenizer.eos_token_id
    k = render_chat_ids(tokenizer, _ANCHOR, tools, **template_kwargs).count(eos) if eos is not None else 0
    if k == 0:
        raise ValueError(
            f"the chat template does not end an assistant turn with the tokenizer's EOS token "
            f"({tokenizer.eos_token!r}); multi-turn token-in/token-out needs it"
        )
    full = render_chat_ids(tokenizer, _ANCHOR + list(messages), tools, add_generation_prompt=True, **template_kwargs)
    ends = [i for i, token in enumerate(full) if token == eos]
    if len(ends) < k:
        raise ValueError("the chat template renders earlier turns differently when more follow; cannot split it")
    return full[ends[k - 1] + 1 :]


def end_turn(ids: Sequence[int], eos_token_id: int | None) -> list[int]:
    """``ids`` ending with the EOS token: it is appended (not trained on) to an output that stopped
    otherwise (the token budget, a stop string), so that :func:`next_turn_ids` can follow."""
    ids = list(ids)
    return ids + [eos_token_id] if eos_token_id is not None and ids[-1:] != [eos_token_id] else ids


class Episode:
    """Token-aligned lists of one conversation as it grows (see :mod:`megarl.api.trajectory`)."""

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.routes: list[Sequence[int] | None] = []
        """MoE (``rollout.return_routed_experts``): per token, the experts of the server's forward that
        produced it (layer-major), None where no server reported them."""

    def add_prompt(self, ids: Sequence[int], routes: Sequence[Sequence[int]] | None = None) -> None:
        """Ids the model did not sample (prompt, tool results, template): not trained on."""
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.routes += list(routes) if routes is not None else [None] * len(ids)

    def add_generated(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        routes: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Sampled ids with their behaviour logprobs and weight versions: trained on."""
        self.input_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        self.routes += list(routes) if routes is not None else [None] * len(ids)

    def add_response(
        self,
        input_tokens: Sequence[int],
        output_tokens: Sequence[int],
        output_logprobs: Sequence[float],
        output_versions: Sequence[int],
        output_routed_experts: Sequence[Sequence[int]] | None = None,
        input_routed_experts: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """One generation whose prompt continues this conversation: its new prompt ids, then its output
        (with the routes the server reported for them: ``input_routed_experts`` has one per input token
        after the first)."""
        n = len(self.input_ids)
        assert list(input_tokens[:n]) == self.input_ids, "the prompt does not continue the conversation"
        new_prompt = input_tokens[n:]
        prompt_routes = None
        if input_routed_experts is not None and new_prompt:
            if len(input_routed_experts) != len(input_tokens) - 1:
                raise ValueError(
                    f"{len(input_tokens)} input tokens but input routed experts for {len(input_routed_experts)} "
                    f"(one per input token after the first: {len(input_tokens) - 1})"
                )
            rows = [None, *input_routed_experts]  # token i: the forward at position i - 1
            prompt_routes = rows[n : len(input_tokens)]
        self.add_prompt(new_prompt, prompt_routes)
        self.add_generated(output_tokens, output_logprobs, output_versions, output_routed_experts)

    def add_model_response(self, resp) -> None:
        """:meth:`add_response` of a :class:`~megarl.api.io_struct.ModelResponse`, its routes included."""
        self.add_response(
            resp.input_tokens,
            resp.output_tokens,
            resp.output_logprobs,
            resp.output_versions,
            resp.output_routed_experts,
            resp.input_routed_experts,
        )

    def to_trajectory(self, reward: float) -> dict[str, Any]:
        """The conversation as a one-row trajectory (with ``routed_experts`` where a server reported any)."""
        traj = build_trajectory(self.input_ids, self.loss_mask, self.logprobs, self.versions, reward)
        width = next((len(r) for r in self.routes if r is not None), 0)
        if width:
            routed = torch.full((len(self.routes), width), -1, dtype=torch.int16)
            for i, row in enumerate(self.routes):
                if row is not None:
                    routed[i] = torch.tensor(row, dtype=torch.int16)
            traj["routed_experts"] = routed[None]
        return traj
