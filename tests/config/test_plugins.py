"""Plug-ins by config: workflow, eval_workflow, reward_fn and actor.loss are checked when the config loads."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.config import GRPOConfig
from megarl.config.base import ConfigError
from megarl.run.prelaunch import build_config

BASE = ["configs/arithmetic_grpo_cpu.yaml"]

USER_MODULE = """
import sys

from megarl.api.workflow_api import RolloutWorkflow


class NeedsTemperature(RolloutWorkflow):
    def __init__(self, gconfig, temperature_bonus):
        self.gconfig, self.temperature_bonus = gconfig, temperature_bonus

    async def arun_episode(self, engine, data):
        return None


class NotAWorkflow:
    def arun_episode(self, engine, data):  # not async
        return None


def two_argument_loss(logprobs, advantages):
    return -advantages * logprobs


def one_argument_reward(completion):
    return 1.0


def trl_named_reward(prompt, completion, prompt_ids, completion_ids, **row):
    return 1.0


def areal_named_reward(prompt, completions, prompt_ids, completion_ids, **row):
    return 1.0


def exiting_reward(prompt, completions, prompt_ids, completion_ids, **row):
    sys.exit(3)


def needs_solution_reward(prompt, completions, prompt_ids, completion_ids, answer, solution):
    return 1.0


def scaled_loss(logprobs, anchor_logprobs, advantages, loss_mask, *, cu_seqlens, config, beta, clip=1.0):
    return -beta * advantages * logprobs


def any_keyword_loss(logprobs, anchor_logprobs, advantages, loss_mask, **kwargs):
    return -advantages * logprobs
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's, importable as ``my_plugins`` (as from the directory a run starts in)."""
    (tmp_path / "my_plugins.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_plugins"
    sys.modules.pop("my_plugins", None)


def _load(*overrides: str) -> GRPOConfig:
    return build_config(GRPOConfig, BASE, list(overrides))


def _error(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        _load(*overrides)
    return err.value


# ---------------------------------------------------------------- workflow


def test_builtin_workflows_by_short_name_with_their_arguments():
    config = _load("workflow.type=multi_turn", "workflow.kwargs.max_turns=3")
    assert config.workflow.class_path == "megarl.workflow.multi_turn.MultiTurnReflectionWorkflow"
    assert config.workflow.kwargs == {"max_turns": 3}
    assert _load().workflow.class_path == "megarl.workflow.rlvr.RLVRWorkflow"


def test_a_misspelled_workflow_argument_names_what_the_class_takes():
    err = _error("workflow.type=multi_turn", "workflow.kwargs.max_turnz=3")
    assert err.key == "workflow.type"
    assert "takes no argument(s) ['max_turnz']" in err.message and "'max_turns'" in err.message


def test_user_workflow_class_is_imported_and_its_constructor_checked(user_module):
    config = _load(f"workflow.type={user_module}.NeedsTemperature", "workflow.kwargs.temperature_bonus=0.1")
    assert config.workflow.type == f"{user_module}.NeedsTemperature"
    err = _error(f"workflow.type={user_module}.NeedsTemperature")  # its own argument is missing
    assert err.key == "workflow.type" and "missing a required argument: 'temperature_bonus'" in err.message
    err = _error(f"workflow.type={user_module}.NotAWorkflow")
    assert "has no 'async def arun_episode" in err.message
    err = _error(f"workflow.type={user_module}.Missing")
    assert "has no attribute 'Missing'" in err.message
    err = _error("workflow.type=no_such_package.Workflow")
    assert "cannot import module 'no_such_package'" in err.message
    err = _error("workflow.type=reflection")
    assert "neither a built-in workflow ['multi_turn', 'rlvr'] nor 'package.module.Class'" in err.message
    err = _error("workflow.type=multiturn")
    assert "['multi_turn', 'rlvr'] (did you mean 'multi_turn'?) nor" in err.message, err.message


def test_an_agent_class_is_a_workflow_by_config():
    """AReaL's agent API (``async def run(data, **extra_kwargs)``) runs behind megarl's OpenAI-compatible proxy."""
    agent = "examples.workflows.openai_agent.CalculatorAgent"
    config = _load(f"workflow.type={agent}", "workflow.kwargs.max_turns=2")
    here = f"{Path.cwd() / 'examples/workflows/openai_agent.py'}:CalculatorAgent"  # found from the working directory
    assert config.workflow.class_path == here and config.workflow.kwargs == {"max_turns": 2}
    err = _error(f"workflow.type={agent}", "workflow.kwargs.max_turnz=2")
    assert "takes no argument(s) ['max_turnz']" in err.message


def test_eval_workflow_is_checked_like_the_training_one():
    assert _load("eval_workflow.type=rlvr").eval_workflow.type == "rlvr"
    err = _error("eval_workflow.type=multi_turn", "eval_workflow.kwargs.turns=2")
    assert err.key == "eval_workflow.type"


def test_grouped_rollout_is_group_size_and_the_grpo_group_follows_it():
    err = _error("workflow.type=grouped")
    assert "set group_size: N instead" in err.message
    err = _error("workflow.group_size=2")  # the arithmetic config's actor.group_size is ${gconfig.n_samples} = 8
    assert err.key == "actor.group_size" and "gconfig.n_samples=8 x workflow.group_size=2 = 16" in err.message
    assert "(write `group_size: 16`)" in err.message  # the hint is the product: n_samples alone fails again
    config = _load("workflow.group_size=4", "gconfig.n_samples=2", "actor.group_size=8")
    assert config.group_size == 8


# ---------------------------------------------------------------- reward and loss


def test_reward_fn_signature_is_checked(user_module):
    err = _error(f"reward_fn={user_module}.one_argument_reward")
    assert err.key == "reward_fn" and "fn(prompt, completions, prompt_ids, completion_ids, **row)" in err.message
    assert _load("reward_fn=examples.rewards.brief_answer.brief_answer_reward").reward_fn.endswith(
        "brief_answer_reward"
    )


@pytest.fixture
def prompt_completion_rows(tmp_path) -> str:
    """A dataset in TRL's prompt-completion format: each row has a ``completion`` column."""
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "completion": f" {i + 1}"} for i in range(16)]
    path = tmp_path / "prompt_completion.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_row_column_on_a_reward_parameter_is_refused_naming_both(user_module, prompt_completion_rows):
    """The run calls fn(prompt, completions, prompt_ids, completion_ids, **row): a reward whose second
    parameter is named ``completion``, on rows with a ``completion`` column, would fail every call with
    "got multiple values for argument 'completion'"; the config check says so before the run."""
    data = f"train_dataset.path={prompt_completion_rows}"
    err = _error(f"reward_fn={user_module}.trl_named_reward", data)
    assert err.key == "reward_fn", err
    assert "column 'completion'" in err.message and "parameter 'completion'" in err.message, err.message
    assert "completion text (argument 2)" in err.message, err.message
    assert _load(f"reward_fn={user_module}.areal_named_reward", data).reward_fn.endswith("areal_named_reward")


def test_the_reward_check_calls_it_with_the_rows_columns(user_module, prompt_completion_rows):
    """A parameter no row column fills is refused at load, as the first call would fail."""
    err = _error(f"reward_fn={user_module}.needs_solution_reward", f"train_dataset.path={prompt_completion_rows}")
    assert err.key == "reward_fn" and "missing a required argument: 'solution'" in err.message, err.message


def test_a_reward_calling_sys_exit_is_a_config_error_naming_it_and_the_exit_code(user_module, tmp_path):
    """sys.exit raises SystemExit, which ``except Exception`` lets through: megarl would stop without a word."""
    err = _error(f"reward_fn={user_module}.exiting_reward")
    assert err.key == "reward_fn" and "it raised:" in err.message and "SystemExit: 3" in err.message, err.message
    (tmp_path / "exits_on_import.py").write_text("import sys\n\nsys.exit('bye')\n")
    err = _error(f"reward_fn={tmp_path / 'exits_on_import.py'}:fn")
    assert err.key == "reward_fn" and "importing 'exits_on_import' called sys.exit('bye')" in err.message, err.message


def test_user_loss_is_imported_and_its_signature_checked(user_module):
    assert (
        _load("actor.loss=examples.losses.cispo.cispo_loss").actor.loss
        == f"{Path.cwd() / 'examples/losses/cispo.py'}:cispo_loss"
    )
    err = _error(f"actor.loss={user_module}.two_argument_loss")
    assert err.key == "actor.loss" and "cu_seqlens, config" in err.message
    err = _error("actor.loss=grpoo")
    assert err.key == "actor.loss" and (
        "'grpoo' is invalid: neither a built-in loss ['dapo', 'dr_grpo', 'grpo', 'gspo', 'ppo'] "
        "(did you mean 'grpo'?) nor 'package.module.name' or 'path/to/file.py:name'"
    ) in str(err)


def test_gae_whitens_advantages_over_the_batch_unless_the_config_says_otherwise():
    ppo = _load("algorithm.adv_estimator=gae", "critic={}")
    assert (ppo.actor.adv_norm.mean_level, ppo.actor.adv_norm.std_level) == ("batch", "batch")
    assert ppo.critic.path == "" and ppo.critic.dtype in ("float32", "bfloat16"), (
        "the actor's model, auto dtype resolved"
    )
    mine = _load("algorithm.adv_estimator=gae", "critic.eps_clip=null", "actor.adv_norm.std_level=none")
    assert (mine.actor.adv_norm.mean_level, mine.actor.adv_norm.std_level, mine.critic.eps_clip) == (
        "batch",
        "none",
        None,
    )
    assert _load().actor.adv_norm.mean_level == "group"


def test_builtin_loss_presets_fill_in_what_the_config_does_not_set():
    dapo = _load("actor.loss=dapo")
    assert (dapo.actor.eps_clip_higher, dapo.actor.loss_agg_mode, dapo.dynamic_filter) == (
        0.28,
        "token-mean",
        "uniform_reward",
    )
    assert _load("actor.loss=dapo", "actor.eps_clip_higher=0.3").actor.eps_clip_higher == 0.3, "the user's key wins"
    dr = _load("actor.loss=dr_grpo")
    assert (dr.actor.loss_agg_mode, dr.actor.adv_norm.std_level, dr.actor.dr_grpo_norm_len) == (
        "seq-mean-token-sum-norm",
        "none",
        dr.gconfig.max_new_tokens,
    )
    gspo = _load("actor.loss=gspo")
    assert gspo.actor.importance_sampling_level == "sequence"
    assert (gspo.actor.eps_clip, gspo.actor.eps_clip_higher) == (3.0e-4, 4.0e-4)
    assert _load("actor.loss=gspo", "actor.eps_clip=0.1").actor.eps_clip == 0.1
    assert _load("actor.loss=grpo").actor.loss_agg_mode == "seq-mean-token-mean"
    assert _load().actor.loss_agg_mode == "token-mean"


# ---------------------------------------------------------------- building


def test_workflows_are_built_with_the_run_arguments_they_take():
    from transformers import AutoTokenizer

    from megarl.config.rollout import WorkflowConfig
    from megarl.models import resolve_model_path
    from megarl.reward.arithmetic import arithmetic_reward_fn
    from megarl.workflow import GroupedRolloutWorkflow, MultiTurnReflectionWorkflow
    from megarl.workflow.build import build_eval_workflow, build_workflow

    config = _load("workflow.type=multi_turn", "workflow.kwargs.max_turns=3")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    run = {
        "reward_fn": arithmetic_reward_fn,
        "gconfig": config.gconfig,
        "tokenizer": tokenizer,
        "max_context_len": config.context_length,
    }
    workflow = build_workflow(config.workflow, run)
    assert isinstance(workflow, MultiTurnReflectionWorkflow)
    assert (workflow.max_turns, workflow.max_context_len, workflow.gconfig) == (3, 256, config.gconfig)
    greedy = config.gconfig.new(n_samples=1, greedy=True)
    evaluation = build_eval_workflow(None, config.workflow, workflow, {**run, "gconfig": greedy})
    assert evaluation.gconfig.greedy and evaluation.max_turns == 3
    assert evaluation.rlvr.async_reward_fn is workflow.rlvr.async_reward_fn, "the twin shares the reward workers"
    grouped = build_workflow(WorkflowConfig("rlvr", group_size=2), {**run, "gconfig": config.gconfig.new(n_samples=1)})
    assert isinstance(grouped, GroupedRolloutWorkflow) and grouped.group_size == 2
    reward_by_path = build_workflow(
        WorkflowConfig("rlvr", {"reward_fn": "examples.rewards.brief_answer.brief_answer_reward"}), run
    )
    assert reward_by_path.reward_fn.__name__ == "brief_answer_reward"
    for wf in (workflow, grouped.workflow, reward_by_path):
        wf.close()


def test_the_evaluation_twin_samples_as_the_evaluator_says():
    from transformers import AutoTokenizer

    from megarl.models import resolve_model_path
    from megarl.run.components import build_workflows

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    for overrides, sampling in (((), (1, True)), (("evaluator.n_samples=4", "evaluator.temperature=0.6"), (4, False))):
        workflow, evaluation = build_workflows(_load(*overrides), tokenizer)
        assert (evaluation.gconfig.n_samples, evaluation.gconfig.greedy) == sampling
        assert workflow.gconfig.n_samples == 8 and not workflow.gconfig.greedy  # training samples as before
        workflow.close()
    assert evaluation.gconfig.temperature == 0.6


def test_a_user_loss_takes_its_own_keyword_arguments_from_the_config(user_module):
    config = _load(f"actor.loss={user_module}.scaled_loss", "actor.loss_kwargs.beta=0.5")
    assert config.actor.loss_kwargs == {"beta": 0.5}
    config = _load(f"actor.loss={user_module}.any_keyword_loss", "actor.loss_kwargs.anything=[1,2]")
    assert config.actor.loss_kwargs == {"anything": [1, 2]}


def test_a_loss_keyword_the_function_does_not_take_names_the_loss_and_the_key(user_module):
    err = _error(f"actor.loss={user_module}.scaled_loss", "actor.loss_kwargs.betta=0.5")
    assert err.key == "actor.loss_kwargs.betta", err
    assert f"actor.loss='{user_module}.scaled_loss' (scaled_loss) takes no keyword argument(s) ['betta']" in str(err)
    assert "its own keyword parameters are ['beta', 'clip']" in str(err)
    err = _error(f"actor.loss={user_module}.scaled_loss")  # a parameter without a default, not given
    assert err.key == "actor.loss" and "missing a required argument: 'beta'" in err.message
    err = _error(f"actor.loss={user_module}.scaled_loss", "actor.loss_kwargs.beta=1", "actor.loss_kwargs.config=1")
    assert err.key == "actor.loss_kwargs.config" and "are the arguments megarl passes to every loss" in err.message
    err = _error("actor.loss=dapo", "actor.loss_kwargs.beta=1")
    assert err.key == "actor.loss_kwargs" and "the built-in loss 'dapo' takes its settings" in err.message


# ---------------------------------------------------------------- agents' export style

AGENT_FLOWS = """
from megarl.workflow.openai_agent import OpenAIAgentWorkflow


class Agent:
    async def run(self, data, **extra_kwargs):
        return 1.0


class AgentFlow(OpenAIAgentWorkflow):  # the user's own wrapping of an agent, with its export style
    def __init__(self, gconfig, tokenizer, export_style="concat"):
        super().__init__(Agent(), gconfig, tokenizer, export_style=export_style)


class PerCallFlow(AgentFlow):
    def __init__(self, gconfig, tokenizer, export_style="individual"):
        super().__init__(gconfig, tokenizer, export_style)


class HiddenPerCallFlow(OpenAIAgentWorkflow):
    def __init__(self, gconfig):
        super().__init__(Agent(), gconfig, export_style="individual")
"""


@pytest.fixture
def agent_flows(tmp_path, monkeypatch):
    (tmp_path / "agent_flows.py").write_text(textwrap.dedent(AGENT_FLOWS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "agent_flows"
    sys.modules.pop("agent_flows", None)


def test_an_agent_exporting_a_row_per_call_is_refused_before_launch(agent_flows):
    """The trainer's GRPO groups need n_samples rows per prompt; 'individual' gives one per call."""
    assert _load(f"workflow.type={agent_flows}.AgentFlow").workflow.kwargs == {}
    err = _error(f"workflow.type={agent_flows}.AgentFlow", "workflow.kwargs.export_style=individual")
    assert err.key == "workflow.kwargs.export_style" and "'individual' is invalid" in str(err)
    assert "gives one row per LLM call, a number that varies from run to run" in err.message
    err = _error(f"eval_workflow.type={agent_flows}.PerCallFlow")  # its default
    assert err.key == "eval_workflow.type" and f"'{agent_flows}.PerCallFlow' is invalid" in str(err)
    assert "use 'concat'" in err.message


def test_the_trainer_refuses_to_build_a_per_call_export_the_config_check_cannot_see(agent_flows):
    from megarl.api.io_struct import GenerationHyperparameters
    from megarl.workflow.build import build_workflow

    config = _load(f"workflow.type={agent_flows}.HiddenPerCallFlow")  # set inside __init__: not visible here
    with pytest.raises(ValueError, match=r"workflow.type='agent_flows.HiddenPerCallFlow': export_style='individual'"):
        build_workflow(config.workflow, {"gconfig": GenerationHyperparameters(n_samples=2), "tokenizer": None})
    config = _load(f"workflow.type={agent_flows}.AgentFlow")
    built = build_workflow(config.workflow, {"gconfig": GenerationHyperparameters(n_samples=2), "tokenizer": None})
    assert built.export_style == "concat"
