"""An LLM judge as the reward (a generative reward model): a chat model grades each completion.

The judge is any chat model behind an OpenAI-compatible API: a vLLM or SGLang server of yours (started
beside the run, on machines of its own), or a hosted API. In the config::

    reward_fn: megarl.reward.judge.judge_reward_fn
    reward:
      timeout_seconds: 60
      kwargs:
        judge_url: "http://judge-node:8000/v1"   # the API's base URL, as an OpenAI client takes it
        judge_model: Qwen/Qwen2.5-7B-Instruct    # optional: the server's only model when left out

Each call sends :data:`DEFAULT_TEMPLATE` (or your ``template``) filled with the task, the reference
answer and the completion to ``{judge_url}/chat/completions``, its reply constrained to the JSON object
``{"score": <integer from 0 to max_score>}`` (``response_format`` with a JSON schema: vLLM, SGLang and
OpenAI's API honour it), and returns ``score / max_score``. Greedy (``temperature`` 0), so one completion
gets one grade. A small judge can spend its tokens on the JSON's optional whitespace: a vLLM server
started with ``--structured-outputs-config '{"disable_any_whitespace": true}'`` holds it to the compact
form. ``extra_body`` adds a server's own fields to each request (a Qwen3 judge's
``chat_template_kwargs: {enable_thinking: false}``, say). The call is an ``async def``: it waits on the rollout's event loop, and a judge that is
busy or restarting is retried until ``reward.timeout_seconds`` (:mod:`megarl.reward.remote`). The
config check grades the dataset's first row once before the run starts: a judge that answers with an
error stops the run there; one that cannot be reached from where the check runs (a login node, say) is
only warned about.
"""

from __future__ import annotations

import json
from typing import Any

from megarl.reward.remote import RemoteRewardError, bearer_headers, fetch_json

DEFAULT_TEMPLATE = """You are grading an answer to a task.

Task:
{prompt}

Reference answer:
{answer}

Answer to grade:
{completion}

Grade the answer from 0 (wrong, or no answer) to {max_score} (correct and complete), comparing it with \
the reference answer. Reply with a JSON object {{"score": <integer>}}."""
"""The grading prompt; a ``template`` of yours takes the same fields: ``{prompt}`` (the task: the row's last
user message, else the prompt's text), ``{completion}``, ``{answer}`` (the row's, "(none)" without one),
``{max_score}``, and any row column by name."""

_MODELS: dict[str, str] = {}
"""judge_url -> the model its server serves (looked up once per process when ``judge_model`` is not given)."""


async def judge_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    judge_url: str,
    judge_model: str | None = None,
    template: str = DEFAULT_TEMPLATE,
    max_score: int = 10,
    max_tokens: int = 32,
    api_key_env: str | None = None,
    extra_body: dict[str, Any] | None = None,
    **row: Any,
) -> float:
    """The judge's grade of ``completions``, from 0 to 1 (see the module doc). ``extra_body``: fields added
    to the request as they are, as the OpenAI client's ``extra_body`` adds them (a server's own options)."""
    base = judge_url.rstrip("/")
    headers = bearer_headers(api_key_env)
    model = judge_model or await served_model(base, headers)
    fields = {**row, "prompt": task_text(prompt, row), "completion": completions, "max_score": max_score}
    fields["answer"] = row.get("answer", "(none)")
    request = grading_request(model, template.format(**fields), max_score, max_tokens, extra_body)
    reply = await fetch_json(f"{base}/chat/completions", request, headers)
    return grade_in(reply, max_score, base)


def grading_request(
    model: str, question: str, max_score: int, max_tokens: int, extra_body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The chat completion request that asks ``model`` the grading ``question``."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "response_format": score_format(max_score),
        **(extra_body or {}),
    }


def task_text(prompt: str, row: dict[str, Any]) -> str:
    """The task as the judge reads it: the row's last user message, else the (chat-templated) prompt."""
    messages = row.get("messages")
    if isinstance(messages, list):
        users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return prompt


def score_format(max_score: int) -> dict[str, Any]:
    """``response_format`` holding the judge's reply to ``{"score": <integer in [0, max_score]>}``."""
    schema = {
        "type": "object",
        "properties": {"score": {"type": "integer", "minimum": 0, "maximum": max_score}},
        "required": ["score"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "grade", "schema": schema, "strict": True}}


def grade_in(reply: Any, max_score: int, base: str) -> float:
    """``score / max_score`` from a chat completion holding ``{"score": n}``."""
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise RemoteRewardError(
            f"{base}/chat/completions answered {str(reply)[:200]!r}: not a chat completion"
        ) from None
    try:
        score = json.loads(content)["score"]
    except (json.JSONDecodeError, KeyError, TypeError):
        score = None
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= max_score:
        raise RemoteRewardError(
            f'the judge at {base} replied {str(content)[:200]!r}, not {{"score": <0..{max_score}>}} '
            "(does its server honour response_format with a JSON schema?)"
        )
    return score / max_score


async def served_model(base: str, headers: dict[str, str]) -> str:
    """The one model ``{base}/models`` lists (cached per process); an error naming them when it is not one."""
    if base not in _MODELS:
        try:
            listing = await fetch_json(f"{base}/models", headers=headers)
        except RemoteRewardError as e:
            raise RemoteRewardError(f"{e} (is judge_url the API's base URL, ending in /v1?)") from None
        data = listing.get("data") if isinstance(listing, dict) else None
        names = [model.get("id") for model in data if isinstance(model, dict)] if isinstance(data, list) else []
        if len(names) != 1:
            raise RemoteRewardError(
                f"{base}/models lists {names or listing!r:.200}: name the judge in reward.kwargs.judge_model"
            )
        _MODELS[base] = names[0]
    return _MODELS[base]
