"""Workflows on a scripted engine: RLVR, multi-turn reflection, grouping, resolution, dumping."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from megarl.api import ModelRequest, ModelResponse, RolloutWorkflow, make_trajectory
from megarl.api.io_struct import GenerationHyperparameters, derive_seed
from megarl.config.rollout import InferenceEngineConfig
from megarl.reward import gsm8k_reward_fn
from megarl.rollout import RolloutPool
from megarl.workflow import (
    GroupedRolloutWorkflow,
    MultiTurnReflectionWorkflow,
    RLVRWorkflow,
    TrajectoryDumper,
    reflection_token_ids,
    resolve_workflow,
)
from megarl.workflow.multi_turn import DEFAULT_REFLECTION_PROMPT

ROW = {"messages": [{"role": "user", "content": "Natalia sold 48 clips..."}], "answer": "#### 72"}
QWEN3_LIKE_TEMPLATE = (  # Qwen3's generation prompt (an empty think block unless thinking) on a ChatML body
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def qwen3_like_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = QWEN3_LIKE_TEMPLATE
    return tokenizer


class ScriptedEngine:
    """Answers each agenerate call with the next scripted completion text (version 3)."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.requests: list[ModelRequest] = []

    def get_version(self) -> int:
        return 3

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False)
        n = len(ids)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=ids,
            output_logprobs=[-0.5] * n,
            output_versions=[3] * n,
            stop_reason="stop",
        )


def test_rlvr_scores_each_sample(tokenizer):
    engine = ScriptedEngine(tokenizer, ["So the answer is \\boxed{72}.", "I think it is 71."])
    workflow = RLVRWorkflow(
        gsm8k_reward_fn, GenerationHyperparameters(n_samples=2, max_new_tokens=32), tokenizer, reward_max_workers=1
    )
    try:
        traj = asyncio.run(workflow.arun_episode(engine, ROW))
    finally:
        workflow.close()
    assert sorted(traj["rewards"].tolist()) == [0.0, 1.0]
    assert len({r.rid for r in engine.requests}) == 1, "samples of one prompt share a rid (same server)"
    assert all(r.gconfig.n_samples == 1 for r in engine.requests)
    prompt = tokenizer.apply_chat_template(
        ROW["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert traj["input_ids"][0, : len(prompt)].tolist() == list(prompt)
    assert traj["versions"][traj["loss_mask"].bool()].eq(3).all()


def test_greedy_twin_shares_the_reward_workers(tokenizer):
    engine = ScriptedEngine(tokenizer, ["\\boxed{72}", "71", "\\boxed{72}"])
    workflow = RLVRWorkflow(gsm8k_reward_fn, GenerationHyperparameters(n_samples=2), tokenizer, reward_max_workers=1)
    greedy = workflow.with_gconfig(GenerationHyperparameters(n_samples=1, greedy=True))
    try:
        sampled = asyncio.run(workflow.arun_episode(engine, ROW))
        evaluated = asyncio.run(greedy.arun_episode(engine, ROW))
        assert greedy.async_reward_fn is workflow.async_reward_fn  # one pool of reward processes
        assert len(workflow.async_reward_fn._get_executor()._processes) == 1
    finally:
        greedy.close()
        workflow.close()
    assert sampled["rewards"].tolist() == [1.0, 0.0] and evaluated["rewards"].tolist() == [1.0]
    assert [r.gconfig.greedy for r in engine.requests] == [False, False, True]
    assert workflow.gconfig.n_samples == 2  # the original keeps its settings


def test_multi_turn_reflection_discount_and_layout(tokenizer):
    engine = ScriptedEngine(tokenizer, ["I think 71", "Hmm, 70?", "Let me redo it: \\boxed{72}"])
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=32)
    workflow = MultiTurnReflectionWorkflow(gsm8k_reward_fn, gconfig, tokenizer, max_turns=5, turn_discount=0.5)
    try:
        traj = asyncio.run(workflow.arun_episode(engine, ROW))
    finally:
        workflow.close()
    assert traj["rewards"].tolist() == [0.25], "correct at the third turn: 0.5 ** 2"
    assert len(engine.requests) == 3 and len({r.rid for r in engine.requests}) == 1
    reflection = reflection_token_ids(tokenizer)
    first, second = engine.requests[0].input_ids, engine.requests[1].input_ids
    answer1 = tokenizer.encode("I think 71", add_special_tokens=False)
    eos = [tokenizer.eos_token_id]
    assert second == first + answer1 + eos + reflection, "answer, EOS, then the reflection prompt as token ids"
    ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].tolist()
    assert ids[: len(engine.requests[2].input_ids)] == engine.requests[2].input_ids
    trained = [t for t, m in zip(ids, mask) if m]
    assert trained == answer1 + tokenizer.encode("Hmm, 70?", add_special_tokens=False) + tokenizer.encode(
        "Let me redo it: \\boxed{72}", add_special_tokens=False
    )
    assert torch.equal(traj["versions"][0] >= 0, traj["loss_mask"][0].bool())


def test_multi_turn_quotes_the_rewards_feedback_when_its_prompt_asks(tokenizer):
    """With ``{feedback}`` in the reflection prompt, the next turn tells the model how its answer failed
    (here the code reward's failing test), and the fixed program earns the discounted reward."""
    from megarl.reward.coding import code_reward_fn
    from megarl.workflow.multi_turn import FEEDBACK_REFLECTION_PROMPT

    wrong = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
    fixed = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    row = {**ROW, "tests": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}
    engine = ScriptedEngine(tokenizer, [wrong, fixed])
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=64)
    workflow = MultiTurnReflectionWorkflow(
        code_reward_fn, gconfig, tokenizer, turn_discount=0.5, reflection_prompt=FEEDBACK_REFLECTION_PROMPT
    )
    try:
        traj = asyncio.run(workflow.arun_episode(engine, row))
    finally:
        workflow.close()
    assert traj["rewards"].tolist() == [0.5]
    first, second = engine.requests[0].input_ids, engine.requests[1].input_ids
    feedback = "on the input '1 2\\n' it printed '-1\\n', expected '3\\n'"
    reflection = reflection_token_ids(tokenizer, FEEDBACK_REFLECTION_PROMPT.replace("{feedback}", feedback))
    assert second[-len(reflection) :] == reflection, tokenizer.decode(second[len(first) :])
    assert "Your answer is wrong: on the input '1 2\\n' it printed '-1\\n'" in tokenizer.decode(second)


def test_multi_turn_gives_up_after_max_turns(tokenizer):
    engine = ScriptedEngine(tokenizer, ["no", "no", "no"])
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=8)
    workflow = MultiTurnReflectionWorkflow(gsm8k_reward_fn, gconfig, tokenizer, max_turns=2)
    try:
        traj = asyncio.run(workflow.arun_episode(engine, ROW))
    finally:
        workflow.close()
    assert traj["rewards"].tolist() == [0.0] and len(engine.requests) == 2


def test_multi_turn_rejects_a_prompt_that_leaves_no_room_for_an_answer(tokenizer, caplog):
    engine = ScriptedEngine(tokenizer, [])
    gconfig = GenerationHyperparameters(n_samples=2, max_new_tokens=16)
    workflow = MultiTurnReflectionWorkflow(gsm8k_reward_fn, gconfig, tokenizer, max_context_len=64)
    row = {"messages": [{"role": "user", "content": "word " * 80}], "answer": "#### 1"}
    prompt_len = len(tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, return_dict=False))
    try:
        assert asyncio.run(workflow.arun_episode(engine, row)) is None
        assert asyncio.run(workflow.arun_episode(engine, row)) is None
    finally:
        workflow.close()
    assert engine.requests == [], "nothing to generate"
    warning = f"a prompt of {prompt_len} tokens leaves no room for an answer in max_context_len=64"
    assert caplog.text.count(warning) == 1, "warned once per workflow"


def test_multi_turn_prompts_every_turn_with_the_first_turns_template_kwargs(qwen3_like_tokenizer):
    """enable_thinking=False: a reflection turn's prompt ends with the empty think block, as the first
    turn's does, not with the thinking generation prompt."""
    tokenizer = qwen3_like_tokenizer
    engine = ScriptedEngine(tokenizer, ["71", "\\boxed{72}"])
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=16)
    workflow = MultiTurnReflectionWorkflow(gsm8k_reward_fn, gconfig, tokenizer, max_turns=2, enable_thinking=False)
    try:
        asyncio.run(workflow.arun_episode(engine, ROW))
    finally:
        workflow.close()
    first, second = (tokenizer.decode(request.input_ids) for request in engine.requests)
    no_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    reflection = f"<|im_start|>user\n{DEFAULT_REFLECTION_PROMPT}<|im_end|>\n"
    assert first.endswith(no_think) and second == first + "71<|im_end|>\n" + reflection + no_think


class _Maybe(RolloutWorkflow):
    def __init__(self, results):
        self.results = list(results)

    async def arun_episode(self, engine, data):
        value = self.results.pop(0)
        return None if value is None else make_trajectory([1], [2] * value, [-0.1] * value, [0] * value, float(value))


def test_seeded_samples_get_their_own_stable_seeds(tokenizer):
    """gconfig.seed: sample i of a prompt carries derive_seed(seed, prompt, i) in every run; unseeded: none."""

    def seeds(seed):
        engine = ScriptedEngine(tokenizer, ["7"] * 3)
        workflow = RLVRWorkflow(
            gsm8k_reward_fn, GenerationHyperparameters(n_samples=3, seed=seed), tokenizer, reward_max_workers=1
        )
        try:
            asyncio.run(workflow.arun_episode(engine, ROW))
        finally:
            workflow.close()
        return [r.gconfig.seed for r in engine.requests], engine.requests[0].input_ids

    (first, prompt), (second, _) = seeds(5), seeds(5)
    assert first == second == [derive_seed(5, prompt, i) for i in range(3)] and len(set(first)) == 3
    assert seeds(6)[0] != first and seeds(None)[0] == [None] * 3


def test_grouped_rejects_a_seeded_inner_workflow():
    inner = _Maybe([])
    inner.gconfig = GenerationHyperparameters(seed=1)
    with pytest.raises(ValueError, match="gconfig.seed=1"):
        GroupedRolloutWorkflow(inner, 4)


def test_grouped_drops_none_members():
    traj = asyncio.run(GroupedRolloutWorkflow(_Maybe([1, None, 3]), 3).arun_episode(None, {}))
    assert traj["rewards"].tolist() == [1.0, 3.0] and traj["input_ids"].shape == (2, 4)
    assert asyncio.run(GroupedRolloutWorkflow(_Maybe([None, None]), 2).arun_episode(None, {})) is None
    with pytest.raises(ValueError, match="group_size"):
        GroupedRolloutWorkflow(_Maybe([]), 0)


def test_grouped_warms_up_and_closes_its_inner_workflow():
    inner, calls = _Maybe([]), []
    inner.warm_up, inner.close = lambda: calls.append("warm_up"), lambda: calls.append("close")
    grouped = GroupedRolloutWorkflow(inner, 2)
    grouped.warm_up()
    grouped.close()
    assert calls == ["warm_up", "close"]
    bare = GroupedRolloutWorkflow(_Maybe([]), 2)  # an inner workflow with neither: nothing to do
    bare.warm_up()
    bare.close()


class Plain:
    """A notebook-style workflow that does not subclass RolloutWorkflow."""

    def __init__(self, scale: int = 1):
        self.scale = scale

    async def arun_episode(self, engine, data):
        return None


def test_resolve_workflow_forms():
    instance = Plain()
    assert resolve_workflow(instance) is instance
    assert resolve_workflow(Plain, {"scale": 3}).scale == 3
    by_path = resolve_workflow(
        "megarl.workflow.grouped.GroupedRolloutWorkflow", {"workflow": instance, "group_size": 2}
    )
    assert isinstance(by_path, GroupedRolloutWorkflow) and by_path.group_size == 2
    grouped = resolve_workflow(Plain, group_size=4)
    assert isinstance(grouped, GroupedRolloutWorkflow) and grouped.group_size == 4
    with pytest.raises(ValueError, match="workflow_kwargs"):
        resolve_workflow(instance, {"scale": 2})
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_workflow("no_such_pkg.Workflow")
    with pytest.raises(ValueError, match="has no attribute"):
        resolve_workflow("megarl.workflow.NoSuchWorkflow")
    with pytest.raises(TypeError, match="not a workflow"):
        resolve_workflow(dict)
    with pytest.raises(TypeError, match="cannot use"):
        resolve_workflow(42)


def test_dumper_format(tokenizer, tmp_path):
    prompt = tokenizer.encode("Q: 2+2?", add_special_tokens=False)
    answer = tokenizer.encode(" 4", add_special_tokens=False)
    traj = make_trajectory(prompt, answer, [-0.1] * len(answer), [5] * len(answer), reward=1.0)
    path = TrajectoryDumper(tmp_path, tokenizer).dump(traj, task_id=42, version=5)
    assert path == tmp_path / "rollout" / "5" / "42.jsonl"
    record = json.loads(path.read_text().splitlines()[0])
    assert record == {
        "task_id": 42,
        "sample_idx": 0,
        "seqlen": len(prompt) + len(answer),
        "prompt_len": len(prompt),
        "head_version": 5,
        "tail_version": 5,
        "reward": 1.0,
        "prompt": "Q: 2+2?",
        "completion": " 4",
        # token by token, for the report's shading
        "tokens": [tokenizer.decode([t]) for t in answer],
        "logprobs": [-0.1] * len(answer),
        "trained": [1] * len(answer),
        "versions": [5] * len(answer),
    }
    assert (
        TrajectoryDumper(tmp_path, tokenizer).path_for(1, 0, is_eval=True)
        == tmp_path / "eval-rollout" / "0" / "1.jsonl"
    )


def test_a_restart_sets_aside_the_trajectories_of_the_steps_it_trains_again(tokenizer, tmp_path):
    """An earlier start dumped versions 0-3; this one resumes at version 2: versions 2 and 3 (episodes of
    steps it trains again, task ids it will reuse) move aside, 0 and 1 stay; nothing is appended to them."""
    prompt, answer = tokenizer.encode("Q: 2+2?", add_special_tokens=False), tokenizer.encode(" 4")
    traj = make_trajectory(prompt, answer, [-0.1] * len(answer), [0] * len(answer), reward=1.0)
    earlier = TrajectoryDumper(tmp_path, tokenizer)
    for version in range(4):
        earlier.dump(traj, task_id=0, version=version)
    earlier.dump(traj, task_id=0, version=3, is_eval=True)
    moved = TrajectoryDumper(tmp_path, tokenizer).set_aside_from(2)
    assert sorted(p.name for p in (tmp_path / "rollout").iterdir() if p.name.isdigit()) == ["0", "1"]
    assert sorted(str(p.relative_to(tmp_path)).split("/")[0::2] for p in moved) == [
        ["eval-rollout", "3"],
        ["rollout", "2"],
        ["rollout", "3"],
    ]
    assert all(p.parent.name.startswith("superseded-") and (p / "0.jsonl").is_file() for p in moved)
    assert TrajectoryDumper(tmp_path, tokenizer).set_aside_from(0) != []  # a fresh restart: all of them


def test_pool_dumps_trajectories(tokenizer, tmp_path):
    engine = ScriptedEngine(tokenizer, ["\\boxed{72}", "wrong"])
    workflow = RLVRWorkflow(
        gsm8k_reward_fn, GenerationHyperparameters(n_samples=2, max_new_tokens=8), tokenizer, reward_max_workers=1
    )
    pool = RolloutPool(engine, InferenceEngineConfig(dump_trajectories=True), 1, TrajectoryDumper(tmp_path, tokenizer))
    pool.start()
    try:
        pool.rollout_batch([ROW], workflow)
    finally:
        pool.destroy()
        workflow.close()
    (path,) = (tmp_path / "rollout" / "3").glob("*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["sample_idx"] for r in records] == [0, 1]
    assert sorted(r["reward"] for r in records) == [0.0, 1.0]
    assert all(r["head_version"] == 3 and "Natalia" in r["prompt"] for r in records)
