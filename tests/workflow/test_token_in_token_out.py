"""Token in, token out: a multi-turn episode trains exactly the ids the server sampled.

A sampler can emit a token sequence the tokenizer would never produce for its own text
(here a word spelt one character per token). Decoding it and encoding the text again gives
other ids (retokenisation drift), and a trainer that re-encoded the conversation would train
tokens nobody sampled, against logprobs of other tokens. megarl's multi-turn workflow keeps
the sampled ids, logprobs and versions of every turn and never re-encodes what the model wrote.
"""

from __future__ import annotations

import asyncio

import pytest

from megarl.api import ModelRequest, ModelResponse
from megarl.api.io_struct import GenerationHyperparameters
from megarl.reward import gsm8k_reward_fn
from megarl.workflow import MultiTurnReflectionWorkflow, reflection_token_ids

ROW = {"messages": [{"role": "user", "content": "Natalia sold 48 clips..."}], "answer": "#### 72"}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def char_by_char(tokenizer, text: str) -> list[int]:
    """``text`` as one token per character: decodes to ``text``, but is not how the tokenizer encodes it."""
    return [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]


class TokenEngine:
    """Answers turn ``k`` with the scripted ids; logprobs and versions tell every sampled token apart."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.requests = list(turns), []

    def get_version(self) -> int:
        return len(self.requests)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        turn = len(self.requests)
        ids = self.turns.pop(0)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=list(ids),
            output_logprobs=[-(turn + i / 100) for i in range(len(ids))],
            output_versions=[turn] * len(ids),
            stop_reason="stop",
        )


def test_multi_turn_trains_the_sampled_ids_not_their_re_encoding(tokenizer):
    first = char_by_char(tokenizer, "Perhaps seventy")  # wrong, and spelt oddly
    second = tokenizer.encode("So \\boxed{72}", add_special_tokens=False)
    text = tokenizer.decode(first)
    assert text == "Perhaps seventy" and tokenizer.encode(text, add_special_tokens=False) != first, (
        "the crafted case must drift when decoded and encoded again"
    )
    engine = TokenEngine([first, second])
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=64)
    workflow = MultiTurnReflectionWorkflow(gsm8k_reward_fn, gconfig, tokenizer, max_turns=3)
    try:
        traj = asyncio.run(workflow.arun_episode(engine, ROW))
    finally:
        workflow.close()
    assert traj["rewards"].tolist() == pytest.approx([0.9]), "right at the second turn"
    # the second turn's prompt continues from the sampled ids themselves
    assert engine.requests[1].input_ids == engine.requests[0].input_ids + first + [tokenizer.eos_token_id] + (
        reflection_token_ids(tokenizer)
    )
    mask = traj["loss_mask"][0].bool()
    assert traj["input_ids"][0][mask].tolist() == first + second, "trained ids are the sampled ids"
    want_logprobs = [-(1 + i / 100) for i in range(len(first))] + [-(2 + i / 100) for i in range(len(second))]
    assert traj["logprobs"][0][mask].tolist() == pytest.approx(want_logprobs), "each id keeps its own logprob"
    assert traj["versions"][0][mask].tolist() == [1] * len(first) + [2] * len(second)
    assert not traj["loss_mask"][0][: len(engine.requests[0].input_ids)].any(), "the prompt is not trained"


def test_a_multi_turn_episode_keeps_each_tokens_route_from_the_call_that_had_it():
    """MoE replay: a conversation's tokens keep the routes of the call that first forwarded them; the next
    turn's new prompt ids (feedback, template) take that call's, and the first token has none."""
    from megarl.workflow.chat import Episode

    episode = Episode()
    episode.add_response([1, 2, 3], [4, 5], [-0.1, -0.2], [0, 0], [[30], [40]], [[10], [20]])
    episode.add_response([1, 2, 3, 4, 5, 6, 7], [8], [-0.3], [1], [[70]], [[11], [21], [31], [41], [50], [60]])
    row = episode.to_trajectory(1.0)
    assert row["routed_experts"][0, :, 0].tolist() == [-1, 10, 20, 30, 40, 50, 60, 70]
    assert row["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    plain = Episode()
    plain.add_response([1, 2], [3], [-0.1], [0])
    assert "routed_experts" not in plain.to_trajectory(0.0), "no server reported routes: no key"
    with pytest.raises(ValueError, match="one per input token after the first"):
        Episode().add_response([1, 2, 3], [4], [-0.1], [0], [[1]], [[1]])
