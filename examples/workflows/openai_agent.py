"""An agent in one file: a tool-calling calculator written against the ``openai`` client.

Run it by config alone (no edit in megarl/):

    megarl run configs/arithmetic_grpo_cpu.yaml workflow.type=examples.workflows.openai_agent.CalculatorAgent \\
        gconfig.max_new_tokens=48

A class with ``async def run(self, data, **extra_kwargs)`` returning a reward is AReaL's agent
API: megarl runs it (``megarl/workflow/openai_agent.py``) behind its OpenAI-compatible proxy
(``megarl/workflow/openai_proxy/``), ``gconfig.n_samples`` runs per prompt. ``extra_kwargs`` holds the run's ``base_url``,
``api_key`` and a shared ``http_client``. Every call is sampled by the policy with the run's
``gconfig`` (leave ``temperature`` unset or equal to it), recorded with its token ids, logprobs
and weight versions, and the run's final conversation is trained on: the sampled tokens only,
never the tool results or the prompt. Append the assistant message as it came back, so that
the next call continues its tokens. The constructor takes ``reward_fn``, so the run's is filled in.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable

from openai import AsyncOpenAI

from megarl.reward.arithmetic import arithmetic_reward_fn

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
# Spelled out as well: some chat templates (SmolLM2's) do not render ``tools``.
SYSTEM_PROMPT = (
    "You may use a calculator: reply with "
    '<tool_call>{"name": "calculate", "arguments": {"expression": "2 + 3"}}</tool_call> '
    "and you will get the result. When you know the answer, reply with only the final number."
)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(arguments: str) -> str:
    """The tool: the value of ``{"expression": ...}``, or an error message the model gets to read."""
    try:
        return str(_evaluate(ast.parse(json.loads(arguments)["expression"], mode="eval").body))
    except Exception as e:  # noqa: BLE001 -- a malformed call is answered, as a tool would
        return f"error: {e}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only numbers, + - * / and parentheses")


class CalculatorAgent:
    """Answers an arithmetic row, calling the calculator as often as it likes (``max_turns`` calls at most).

    ``reward_fn`` scores the last answer (``fn(prompt, completions, prompt_ids, completion_ids, **row)``;
    cheap here, so it runs inline: a slow one belongs in ``megarl.reward.executor.AsyncRewardWrapper``).
    """

    def __init__(self, reward_fn: Callable[..., float] = arithmetic_reward_fn, max_turns: int = 3):
        self.reward_fn = reward_fn
        self.max_turns = max_turns

    async def run(self, data, **extra_kwargs) -> float:
        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            http_client=extra_kwargs["http_client"],
            max_retries=0,
        )
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, *data["messages"]]
        for _ in range(self.max_turns):
            completion = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))  # as it came back: its tokens continue
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)}
                )
        return float(self.reward_fn("", message.content or "", [], [], **data))
