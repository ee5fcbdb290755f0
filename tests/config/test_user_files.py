"""A user's own files named by a config: found beside the config file, in the working directory or by
file path, recorded as an absolute path that a process started elsewhere (the trainer) finds too."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.config import GRPOConfig, save_config
from megarl.config.base import ConfigError
from megarl.run.prelaunch import build_config
from megarl.utils.plugins import import_plugin, locate_plugin
from megarl.workflow.resolve import resolve_should_accept_fn, resolve_workflow

REPO = Path(__file__).resolve().parents[2]
BASE = str(REPO / "configs/arithmetic_grpo_cpu.yaml")

REWARD = """
def my_reward(prompt, completions, prompt_ids, completion_ids, **row):
    return 0.25 if completions == "four" else 0.0
"""

WORKFLOW = """
from megarl.api.workflow_api import RolloutWorkflow


class MyWorkflow(RolloutWorkflow):
    def __init__(self, gconfig, tokenizer, reward_fn):
        self.reward_fn = reward_fn

    async def arun_episode(self, engine, data):
        return None


def accept_all(trajectory):
    return True
"""


@pytest.fixture
def experiment(tmp_path, monkeypatch):
    """``exp/`` holding a config (the arithmetic one plus ``extra`` keys) and ``myreward.py``; the
    working directory elsewhere, ``elsewhere/``; the user's modules forgotten afterwards."""
    folder, elsewhere = tmp_path / "exp", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "myreward.py").write_text(textwrap.dedent(REWARD))
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _config(folder: Path, text: str) -> str:
    (folder / "extra.yaml").write_text(textwrap.dedent(text))
    return str(folder / "extra.yaml")


def _load(*files: str, overrides: tuple[str, ...] = ()) -> GRPOConfig:
    return build_config(GRPOConfig, [BASE, *files], list(overrides))


def test_a_dotted_reward_beside_the_config_file_resolves_and_is_recorded_absolute(experiment):
    config = _load(_config(experiment, "reward_fn: myreward.my_reward\n"))
    assert config.reward_fn == f"{experiment.resolve() / 'myreward.py'}:my_reward"
    reward = import_plugin(config.reward_fn, "reward_fn")
    assert reward("", "four", [], []) == 0.25
    assert reward.__module__ == "myreward" and sys.modules["myreward"].__file__ == str(
        experiment.resolve() / "myreward.py"
    )


def test_a_file_path_resolves_from_the_config_folder_then_the_working_directory(experiment):
    (experiment / "plugins").mkdir()
    (experiment / "plugins" / "flows.py").write_text(textwrap.dedent(WORKFLOW))
    config = _load(
        _config(
            experiment,
            """
        workflow:
          type: plugins/flows.py:MyWorkflow
          kwargs:
            reward_fn: ./myreward.py:my_reward
    """,
        )
    )
    assert config.workflow.type == f"{experiment.resolve() / 'plugins/flows.py'}:MyWorkflow"
    assert config.workflow.kwargs["reward_fn"] == f"{experiment.resolve() / 'myreward.py'}:my_reward"
    # on the command line a relative path starts from the working directory
    (Path.cwd() / "cwd_reward.py").write_text(textwrap.dedent(REWARD).replace("my_reward", "cwd_reward"))
    config = _load(overrides=("reward_fn=cwd_reward.py:cwd_reward",))
    assert config.reward_fn == f"{Path.cwd().resolve() / 'cwd_reward.py'}:cwd_reward"
    config = _load(overrides=("reward_fn=cwd_reward.cwd_reward",))
    assert config.reward_fn == f"{Path.cwd().resolve() / 'cwd_reward.py'}:cwd_reward"
    absolute = f"{experiment / 'myreward.py'}:my_reward"
    assert _load(overrides=(f"reward_fn={absolute}",)).reward_fn == f"{experiment.resolve() / 'myreward.py'}:my_reward"


def test_a_package_beside_the_config_imports_under_its_package_name(experiment):
    package = experiment / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("BONUS = 0.5\n")
    (package / "rewards.py").write_text(
        "from mypkg.helpers import BONUS\n\n\ndef fn(prompt, completions, prompt_ids, completion_ids, **row):\n"
        "    return BONUS\n"
    )
    config = _load(_config(experiment, "reward_fn: mypkg.rewards.fn\n"))
    assert config.reward_fn == f"{package.resolve() / 'rewards.py'}:fn"
    reward = import_plugin(config.reward_fn, "reward_fn")
    assert reward.__module__ == "mypkg.rewards" and reward("", "", [], []) == 0.5


def test_an_installed_package_wins_and_stays_a_dotted_path(experiment):
    (experiment / "megarl").mkdir()  # a same-named folder beside the config does not shadow megarl
    (experiment / "megarl" / "reward.py").write_text("")
    config = _load(_config(experiment, "reward_fn: megarl.reward.arithmetic.arithmetic_reward_fn\n"))
    assert config.reward_fn == "megarl.reward.arithmetic.arithmetic_reward_fn"
    assert locate_plugin("rlvr", "workflow.type", [experiment]) == "rlvr", "a built-in's short name is no path"


def test_not_found_names_the_key_the_value_and_each_place_searched(experiment):
    with pytest.raises(ConfigError) as err:
        _load(_config(experiment, "reward_fn: missing_reward.fn\n"))
    here, there = experiment.resolve(), Path.cwd().resolve()
    assert err.value.key == "reward_fn"
    assert err.value.message == (
        f"'missing_reward.fn': cannot import module 'missing_reward'; searched the installed packages, "
        f"{here / 'missing_reward.py'}, {here / 'missing_reward/__init__.py'}, "
        f"{there / 'missing_reward.py'}, {there / 'missing_reward/__init__.py'}"
    )
    with pytest.raises(ConfigError) as err:
        _load(_config(experiment, "actor:\n  loss: losses/mine.py:loss\n"))
    assert err.value.key == "actor.loss"
    assert (
        f"'losses/mine.py:loss': no such file; searched {here / 'losses/mine.py'}, {there / 'losses/mine.py'}"
        in str(err.value)
    )


def test_a_file_whose_module_name_is_taken_says_rename_it(experiment):
    (experiment / "json.py").write_text(textwrap.dedent(REWARD))
    with pytest.raises(ConfigError, match=r"imports as module 'json', which is .*json/__init__.py: rename the file"):
        _load(_config(experiment, "reward_fn: json.py:my_reward\n"))


def test_the_python_api_takes_both_spellings(experiment, monkeypatch):
    (experiment / "flows.py").write_text(textwrap.dedent(WORKFLOW))
    monkeypatch.chdir(experiment)
    assert resolve_should_accept_fn("flows.accept_all")({}) is True
    workflow = resolve_workflow("flows.py:MyWorkflow", {"gconfig": None, "tokenizer": None, "reward_fn": None})
    assert type(workflow).__name__ == "MyWorkflow"
    with pytest.raises(ValueError, match="'nope.py:MyWorkflow': no such file"):
        resolve_workflow("nope.py:MyWorkflow")


TRAINER_SIDE = """
import asyncio, sys
from megarl.config import GRPOConfig
from megarl.run.prelaunch import load_expr_config
from megarl.reward.executor import AsyncRewardWrapper
from megarl.utils.plugins import import_plugin

config, _ = load_expr_config(["--config", sys.argv[1]], GRPOConfig)
reward = AsyncRewardWrapper(import_plugin(config.reward_fn, "reward_fn"), timeout_seconds=60, max_workers=1)
try:
    score = asyncio.run(reward("", "four", [], []))
    print("reward", float(score), score.outcome)
finally:
    reward.close()
"""


def test_the_saved_config_finds_the_file_from_another_directory_and_a_spawned_reward_worker(experiment, tmp_path):
    """As the trainer ``megarl run`` starts: the saved config, another working directory, no PYTHONPATH;
    the reward runs in a spawned worker, which imports the user's module by name."""
    config = _load(_config(experiment, "reward_fn: myreward.my_reward\n"), overrides=(f"cluster.fileroot={tmp_path}",))
    saved = save_config(config)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", TRAINER_SIDE, str(saved)],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reward 0.25 ok" in result.stdout


USER_SCRIPT = """
import sys

from megarl.api.workflow_api import RolloutWorkflow

print("script imported as", __name__)


def my_reward(prompt, completions, prompt_ids, completion_ids, **row):
    return 0.5 if completions == "four" else 0.0


class MyWorkflow(RolloutWorkflow):
    def __init__(self, reward_fn, greeting="hi"):
        self.reward_fn, self.greeting = reward_fn, greeting

    async def arun_episode(self, engine, data):
        return None


def my_loss(logprobs, anchor_logprobs, advantages, loss_mask, *, cu_seqlens, config, beta):
    return -beta * advantages * logprobs


if __name__ == "__main__":
    from megarl.launcher.cli import main

    print("script launches megarl")
    sys.exit(main(["config", "--save", "--config", sys.argv[1], *sys.argv[2:]]))
"""

CHILD_SIDE = """
import asyncio, sys
from megarl.config import GRPOConfig
from megarl.reward.executor import AsyncRewardWrapper
from megarl.run.prelaunch import load_expr_config
from megarl.utils.plugins import import_plugin
from megarl.workflow.build import build_workflow

config, _ = load_expr_config(["--config", sys.argv[1]], GRPOConfig)  # as each trainer rank does
reward_fn = import_plugin(config.reward_fn, "reward_fn")
workflow = build_workflow(config.workflow, {"reward_fn": reward_fn})
print("workflow", type(workflow).__module__, type(workflow).__name__, workflow.greeting)
loss_fn = import_plugin(config.actor.loss, "actor.loss")  # as megarl.actor.ppo.policy_surrogate does
print("loss", loss_fn.__module__, loss_fn(1.0, 1.0, 1.0, 1.0, cu_seqlens=None, config=config.actor, **config.actor.loss_kwargs))
reward = AsyncRewardWrapper(reward_fn, timeout_seconds=60, max_workers=1)
try:
    score = asyncio.run(reward("", "four", [], []))
    print("reward", float(score), score.outcome)
finally:
    reward.close()
"""


def _python(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_main_names_the_running_script_for_the_launcher_and_the_trainer_ranks(tmp_path):
    """A user's script defines a reward, a workflow and a loss and launches megarl from Python, naming
    them ``__main__.X``. The saved config (what ``megarl run`` hands to torchrun's ranks, whose
    ``__main__`` is another program) names the script's file; a process started elsewhere reads it
    as the trainer does: the same workflow, loss (with its config keyword) and reward, the latter in a
    spawned reward worker, and the script's launch under ``if __name__ == "__main__"`` not run again."""
    script = tmp_path / "mine" / "my_script.py"
    script.parent.mkdir()
    script.write_text(USER_SCRIPT)
    keys = [
        "reward_fn=__main__.my_reward",
        "workflow.type=__main__.MyWorkflow",
        "workflow.kwargs.greeting=hello",
        "actor.loss=__main__.my_loss",
        "actor.loss_kwargs.beta=2.0",
        f"cluster.fileroot={tmp_path / 'runs'}",
    ]
    launched = _python([str(script), BASE, *keys], cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout.count("script imported as") == 1, "the launching process imports its script once"
    for key, name in (("reward_fn", "my_reward"), ("type", "MyWorkflow"), ("loss", "my_loss")):
        assert f"{key}: {script}:{name}\n" in launched.stdout, launched.stdout
    saved = tmp_path / "runs" / "arithmetic-grpo-cpu" / "trial0" / "config.yaml"
    child = _python(["-c", CHILD_SIDE, str(saved)], cwd=Path("/"))
    assert child.returncode == 0, child.stderr[-3000:]
    assert "script imported as my_script" in child.stdout and "script launches megarl" not in child.stdout
    assert "workflow my_script MyWorkflow hello" in child.stdout
    assert "loss my_script -2.0" in child.stdout
    assert "reward 0.5 ok" in child.stdout


def test_main_without_a_script_or_the_name_says_what_main_means(experiment, monkeypatch):
    """Under ``python -c`` or an interactive session there is no script; a name the script lacks is named."""
    script = experiment / "launcher_script.py"
    script.write_text("def my_reward(prompt, completions, prompt_ids, completion_ids, **row):\n    return 1.0\n")
    main = type(sys)("__main__")
    main.my_reward = lambda *args, **row: 1.0
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(ConfigError, match=r"this program runs none \(an interactive session or python -c\)"):
        locate_plugin("__main__.my_reward", "reward_fn")
    main.__file__ = str(script)
    assert locate_plugin("__main__.my_reward", "reward_fn") == f"{script.resolve()}:my_reward"
    assert import_plugin("__main__.my_reward", "reward_fn") is main.my_reward, "the script is not imported again"
    with pytest.raises(ConfigError, match=r"the running script .*launcher_script.py defines no 'other_reward'"):
        locate_plugin("__main__.other_reward", "workflow.kwargs.reward_fn")
