"""AReaL's names at megarl's public paths, and old paths of moved modules still importing.

``TUTORIAL_NAMES`` is every name AReaL's GSM8K walkthrough and multi-turn notebook import (and the
RolloutWorkflow reference's ``workflow_context``), with the path a port imports it from in megarl;
``docs/name-mapping.md`` lists the same pairs, and each path must import. ``ACTOR_CALLS`` and the
like are the calls those tutorials make on the objects.
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

from megarl.utils.deprecation import REMOVED_IN
from tests.test_layering import MOVED

REPO = Path(__file__).resolve().parents[2]

TUTORIAL_NAMES = {
    "areal.api.cli_args.GRPOConfig": "megarl.config.GRPOConfig",
    "areal.api.cli_args.load_expr_config": "megarl.run.prelaunch.load_expr_config",
    "areal.api.cli_args.GenerationHyperparameters": "megarl.api.io_struct.GenerationHyperparameters",
    "areal.api.cli_args.SGLangConfig": "megarl.config.SGLangConfig",
    "areal.api.engine_api.InferenceEngine": "megarl.api.engine_api.InferenceEngine",
    "areal.api.io_struct.AllocationMode": "megarl.config.AllocationMode",
    "areal.api.io_struct.FinetuneSpec": "megarl.api.io_struct.FinetuneSpec",
    "areal.api.io_struct.ModelRequest": "megarl.api.io_struct.ModelRequest",
    "areal.api.io_struct.WeightUpdateMeta": "megarl.run.weight_sync.WeightUpdateMeta",
    "areal.api.workflow_api.RolloutWorkflow": "megarl.api.workflow_api.RolloutWorkflow",
    "areal.engine.ppo.actor.FSDPPPOActor": "megarl.run.actor.PPOActor",
    "areal.engine.sglang_remote.RemoteSGLangEngine": "megarl.rollout.RemoteSGLangEngine",
    "areal.engine.vllm_remote.RemoteVLLMEngine": "megarl.rollout.RemoteVLLMEngine",
    "areal.infra.workflow_context": "megarl.api.context",
    "areal.reward.math_parser.extract_answer": "megarl.reward.math_parser.extract_answer",
    "areal.reward.math_parser.math_equal": "megarl.reward.math_parser.math_equal",
    "areal.utils.data.concat_padded_tensors": "megarl.api.trajectory.concat_padded_tensors",
    "areal.utils.network.find_free_ports": "megarl.utils.network.find_free_ports",
    "areal.utils.saver.Saver": "megarl.run.saver.Saver",
    "areal.utils.evaluator.Evaluator": "megarl.run.evaluator.Evaluator",
    "areal.utils.stats_logger.StatsLogger": "megarl.run.stats_logger.StatsLogger",
    "areal.utils.stats_tracker": "megarl.utils.stats_tracker",
    "areal.workflow.rlvr.RLVRWorkflow": "megarl.workflow.rlvr.RLVRWorkflow",
    "areal.core.dist_rollout.DistRolloutCoordinator": "megarl.rollout.coordinator.DistRolloutCoordinator",
}
"""AReaL's import -> megarl's (``docs/name-mapping.md``, "AReaL's imports")."""

ACTOR_CALLS = (
    "create_process_group",
    "initialize",
    "connect_engine",
    "prepare_batch",
    "compute_logp",
    "compute_advantages",
    "ppo_update",
    "step_lr_scheduler",
    "update_weights",
    "set_version",
    "get_version",
)
ROLLOUT_CALLS = ("initialize", "agenerate", "prepare_batch", "rollout_batch", "pause", "resume", "set_version")
STATS_TRACKER_CALLS = ("scalar", "stat", "denominator", "record_timing", "scope", "export")


def resolve(path: str):
    """The object a dotted path names: a module, or a module's attribute."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("areal,megarl_path", sorted(TUTORIAL_NAMES.items()))
def test_every_tutorial_name_imports_from_its_documented_path(areal, megarl_path):
    assert resolve(megarl_path) is not None


def _module_of(file: str) -> str:
    """``megarl/a/b.py`` -> ``megarl.a.b``; a package's ``__init__.py`` -> the package."""
    return file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def test_the_name_mapping_page_lists_the_same_paths():
    page = (REPO / "docs" / "name-mapping.md").read_text()
    rows = dict(re.findall(r"^\| `(areal\.[\w.]+)` \| `(megarl\.[\w.]+)` \|", page, re.M))
    assert rows == TUTORIAL_NAMES
    old_paths = [_module_of(f) for f in MOVED]
    assert [p for p in old_paths if f"`{p}`" not in page] == [], "the page lists every old path"


def test_the_tutorials_calls_exist_on_the_objects():
    actor, rollout = resolve("megarl.run.actor.PPOActor"), resolve("megarl.rollout.RemoteSGLangEngine")
    stats_tracker, meta = resolve("megarl.utils.stats_tracker"), resolve("megarl.run.weight_sync.WeightUpdateMeta")
    for owner, calls in ((actor, ACTOR_CALLS), (rollout, ROLLOUT_CALLS), (stats_tracker, STATS_TRACKER_CALLS)):
        assert [c for c in calls if not callable(getattr(owner, c, None))] == [], owner
    assert callable(meta.from_megatron_xccl) and callable(meta.from_disk)


def test_weight_update_meta_constructors_name_the_servers_tp_and_mode():
    from megarl.config import AllocationMode
    from megarl.run.weight_sync import WeightUpdateMeta

    alloc = AllocationMode.from_str("vllm:d2t2+megatron:d1p1t2")
    xccl = WeightUpdateMeta.from_megatron_xccl(alloc)
    assert (xccl.inference_tp, xccl.config.mode) == (2, "sharded")
    disk = WeightUpdateMeta.from_disk(alloc, path="/shared/weights")
    assert (disk.inference_tp, disk.config.mode, disk.path) == (2, "disk", "/shared/weights")


def test_the_tutorials_spellings_of_megarl_calls_bind():
    """What the walkthrough and the multi-turn notebook write, verbatim: AReaL's parallel-strategy sizes, its
    FSDP-named weight-update constructor, the notebook's ``should_accept=``; and a saver config given where
    the allocation goes is a TypeError saying what goes there, not an AttributeError from inside."""
    import inspect

    from megarl.config import AllocationMode
    from megarl.run.actor import PPOActor
    from megarl.run.weight_sync import WeightUpdateMeta

    alloc = AllocationMode.from_str("sglang:d1p1t1+megatron:d2p1t2c2")
    strategy = alloc.train
    assert (strategy.dp_size, strategy.tp_size, strategy.pp_size, strategy.cp_size) == (2, 2, 1, 2)
    assert WeightUpdateMeta.from_fsdp_xccl(alloc).config.mode == WeightUpdateMeta.from_megatron_xccl(alloc).config.mode
    inspect.signature(PPOActor.prepare_batch).bind(None, [], granularity=1, workflow="w", should_accept=bool)
    actor = PPOActor.__new__(PPOActor)
    with pytest.raises(TypeError, match="not both"):
        actor.prepare_batch([], should_accept_fn=bool, should_accept=bool)
    from megarl.config.run import SaverConfig

    with pytest.raises(TypeError, match=r"takes the allocation mode .*not SaverConfig"):
        WeightUpdateMeta.from_disk(SaverConfig())


def test_finetune_spec_sizes_the_schedule_as_arealS():
    from megarl.api.io_struct import FinetuneSpec

    assert FinetuneSpec(total_train_epochs=3, dataset_size=100, train_batch_size=8).total_train_steps == 36
    with pytest.raises(ValueError, match="train_batch_size"):
        FinetuneSpec(total_train_epochs=1, dataset_size=100, train_batch_size=0)


def test_create_process_group_takes_the_allocation_once():
    from megarl.run.actor import PPOActor

    actor = PPOActor.__new__(PPOActor)  # no engine: the argument check comes first
    with pytest.raises(TypeError, match="once"):
        actor.create_process_group("megatron:d1p1t1", parallel_strategy="megatron:d1p1t1")
    with pytest.raises(TypeError, match="once"):
        actor.create_process_group()


def test_the_actor_says_to_connect_before_a_weight_update():
    from megarl.run.actor import PPOActor

    actor = PPOActor.__new__(PPOActor)
    actor.weight_sync = None
    with pytest.raises(RuntimeError, match=r"connect_engine\(rollout, weight_update_meta\)"):
        actor.update_weights(None)
    with pytest.raises(RuntimeError, match="connect_engine"):
        actor.prepare_batch(None)


@pytest.mark.parametrize("call", ["connect_engine", "prepare_batch", "update_weights"])
def test_the_actor_below_the_servers_names_the_one_with_the_server_calls(call):
    """A port written when the documented actor was ``megarl.actor.ppo.MegatronPPOActor``."""
    from megarl.actor.ppo import MegatronPPOActor

    actor = MegatronPPOActor.__new__(MegatronPPOActor)
    with pytest.raises(AttributeError, match=rf"MegatronPPOActor has no {call}\(\).*megarl\.run\.actor\.PPOActor"):
        getattr(actor, call)
    with pytest.raises(AttributeError, match=r"actor = PPOActor\(config=config\.actor\)"):
        getattr(actor, call)
    with pytest.raises(AttributeError, match="'MegatronPPOActor' object has no attribute 'no_such_call'"):
        actor.no_such_call  # noqa: B018 -- any other missing name: the usual error
    assert all(callable(getattr(actor, c)) for c in ("compute_logp", "ppo_update", "set_version"))


@pytest.mark.parametrize("old_file,new", sorted(MOVED.items()))
def test_an_old_path_gives_the_moved_names_with_a_deprecation_warning(old_file, new):
    old = _module_of(old_file)
    new_module = importlib.import_module(new)
    public = list(getattr(new_module, "__all__", [])) or [
        n for n, v in vars(new_module).items() if not n.startswith("_") and getattr(v, "__module__", "") == new
    ]
    assert public, f"{new} defines no public name"
    shim = importlib.import_module(old)
    for name in public:
        moved = rf"{re.escape(old)}\.{name} moved to {re.escape(new)}\.{name}; .* removed in megarl {REMOVED_IN}"
        with pytest.warns(DeprecationWarning, match=moved):
            assert getattr(shim, name) is getattr(new_module, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            shim.no_such_name  # noqa: B018 -- an unknown name is an AttributeError, not a warning


def test_the_loss_configs_moved_out_of_the_engine_configs_still_import_from_there():
    """``megarl.config.train`` is on the config reference page: its PPO names moved to ``megarl.config.ppo``."""
    import megarl.config.ppo as ppo
    import megarl.config.train as train

    for name in ("PPOActorConfig", "PPOCriticConfig", "AlgorithmConfig", "NormConfig", "LOSS_PRESETS"):
        moved = (
            rf"megarl\.config\.train\.{name} moved to megarl\.config\.ppo\.{name}; .* removed in megarl {REMOVED_IN}"
        )
        with pytest.warns(DeprecationWarning, match=moved):
            assert getattr(train, name) is getattr(ppo, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        train.no_such_name  # noqa: B018 -- an unknown name is the usual error


def test_the_seed_tutorials_old_megarl_imports_still_work():
    """The imports a port written against megarl's earlier layout made (changelog, "Layering")."""
    with pytest.warns(DeprecationWarning):
        from megarl.bridge.update import WeightUpdateMeta
        from megarl.utils.evaluator import Evaluator
        from megarl.utils.saver import Saver
        from megarl.utils.stats_logger import StatsLogger
    assert WeightUpdateMeta is resolve("megarl.run.weight_sync.WeightUpdateMeta")
    assert (Saver, Evaluator, StatsLogger) == tuple(
        resolve(f"megarl.run.{m}.{c}")
        for m, c in (("saver", "Saver"), ("evaluator", "Evaluator"), ("stats_logger", "StatsLogger"))
    )


def test_the_serving_names_megarl_rollout_exported_forward_with_a_warning():
    """``from megarl.rollout import InferenceServer, vllm_launch_spec`` (the name mapping's own-server
    example before 0.1.0) gives ``megarl.serving``'s names with a warning naming the release that removes them."""
    import megarl.rollout as rollout
    import megarl.serving as serving

    for name in rollout.MOVED_TO_SERVING:
        moved = rf"megarl\.rollout\.{name} moved to megarl\.serving\.{name}; .* removed in megarl {REMOVED_IN}"
        with pytest.warns(DeprecationWarning, match=moved):
            assert getattr(rollout, name) is getattr(serving, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        rollout.no_such_name  # noqa: B018 -- an unknown name is the usual error
