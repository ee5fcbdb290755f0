"""RecoverHandler: a real engine round trip (weights, optimizer, LR, version, RNG), crash leftovers, modes, layouts."""

from __future__ import annotations

import errno
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.config.allocation import AllocationMode, TrainingAllocation
from megarl.config.run import RecoverConfig
from megarl.run.recover import RecoverHandler, RecoverInfo
from tests.actor.dist_utils import run_ranks

# ---------------------------------------------------------------------------------- real engine


def draws() -> list[float]:
    """One number from each RNG the handler restores."""
    return [random.random(), float(np.random.rand()), torch.rand(()).item()]


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.model[0].named_parameters()}


def observe(engine, batch: dict) -> dict:
    """What a resumed run must reproduce: RNG draws, weights, the next loss, the weights and LR after it."""
    from tests.actor.workers import _step

    out = {"draws": draws(), "weights": weights(engine), "version": engine.get_version()}
    out["loss"] = _step(engine, batch)
    out["weights_after"], out["lr_after"] = weights(engine), engine.current_lr
    return out


def dump_then_recover(model_dir: str, run_dir: str) -> dict:
    """One rank: a step and a dump, observed; then a fresh engine loads the dump and is observed the same way."""
    from tests.actor.workers import _ckpt_engine, _step, make_batch

    engine = _ckpt_engine(model_dir, "d1p1t1", "float32")
    batches = [make_batch([7, 12, 5, 9], seed=s) for s in range(2)]
    _step(engine, batches[0])
    engine.set_version(1)
    config = RecoverConfig(mode="auto", freq_steps=1)
    info = RecoverInfo(0, 0, 0, rollout_version=1, dataloader_state={"consumed": 4}, extra={"note": "x"})
    assert RecoverHandler(config, Path(run_dir)).maybe_dump(engine, info)
    at_dump = {**observe_optimizer(engine), **observe(engine, batches[1])}
    engine = _ckpt_engine(model_dir, "d1p1t1", "float32")  # fresh engine and handler, as after a restart
    loaded = RecoverHandler(config, Path(run_dir)).load(engine)
    after_load = {**observe_optimizer(engine), **observe(engine, batches[1])}
    return {"at_dump": at_dump, "after_load": after_load, "info": loaded}


def observe_optimizer(engine) -> dict:
    """Adam moments and step counts of every parameter, and the LR scheduler's step count."""
    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    states = [state for opt in optimizers for state in opt.optimizer.state.values()]
    return {
        "moments": [torch.cat([s["exp_avg"].flatten(), s["exp_avg_sq"].flatten()]) for s in states],
        "adam_steps": sorted({float(s["step"]) for s in states}),
        "lr_steps": engine.lr_scheduler.num_steps,
    }


@pytest.fixture(scope="module")
def recovered(tiny_model_dir, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("recover_run")
    out = run_ranks(
        1,
        "tests.run.test_recover:dump_then_recover",
        model_dir=str(tiny_model_dir("llama")),
        run_dir=str(run_dir),
        timeout=300,
    )[0]
    return {**out, "run_dir": run_dir}


@pytest.mark.multiproc
def test_dump_then_load_restores_engine_rng_and_info(recovered):
    want, got = recovered["at_dump"], recovered["after_load"]
    assert got["draws"] == want["draws"] and got["version"] == want["version"] == 1
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), name
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert all(torch.equal(g, w) for g, w in zip(got["moments"], want["moments"], strict=True))
    assert got["lr_steps"] == want["lr_steps"] == 1 and got["lr_after"] == want["lr_after"]
    info = recovered["info"]
    assert (info.global_step, info.rollout_version) == (0, 1)
    assert info.dataloader_state == {"consumed": 4} and info.extra == {"note": "x"}
    assert sorted(p.name for p in (recovered["run_dir"] / "recover").iterdir()) == ["step0"]


@pytest.mark.multiproc
def test_dump_then_load_restores_adam_step_count(recovered):
    want, got = recovered["at_dump"], recovered["after_load"]
    assert got["adam_steps"] == want["adam_steps"] == [1.0]
    for name, tensor in want["weights_after"].items():  # the next update uses the same bias correction
        torch.testing.assert_close(got["weights_after"][name], tensor, rtol=1e-5, atol=1e-7, msg=name)


# ---------------------------------------------------------------------------------- stub engine


class StubEngine:
    """Writes / reads a marker file where MegatronEngine writes / reads its checkpoint."""

    def __init__(self, rank: int = 0, dp: int = 1, tp: int = 1, fail_save: bool = False):
        alloc = TrainingAllocation(dp=dp, tp=tp)
        self.parallel = SimpleNamespace(rank=rank, world_size=alloc.world_size, alloc=alloc)
        self.version = 0
        self.fail_save = fail_save
        self.loaded_from: str | None = None

    def save(self, meta) -> None:
        Path(meta.path).mkdir(parents=True)
        (Path(meta.path) / "version").write_text(str(self.version))
        if self.fail_save:
            raise KeyboardInterrupt("killed mid-dump")

    def load(self, meta) -> None:
        self.loaded_from = meta.path
        self.version = int((Path(meta.path) / "version").read_text())


def info_at(step: int) -> RecoverInfo:
    return RecoverInfo(epoch=0, epoch_step=step, global_step=step, rollout_version=step)


def dump(run_dir: Path, step: int, **engine) -> StubEngine:
    stub = StubEngine(**engine)
    stub.version = step
    RecoverHandler(RecoverConfig(mode="auto"), run_dir).maybe_dump(stub, info_at(step), force=True)
    return stub


def load(run_dir: Path, mode: str = "auto", **engine) -> tuple[StubEngine, RecoverInfo | None]:
    stub = StubEngine(**engine)
    return stub, RecoverHandler(RecoverConfig(mode=mode), run_dir).load(stub)


def test_crash_mid_dump_leaves_previous_point_and_next_dump_cleans_up(tmp_path):
    dump(tmp_path, 3)
    with pytest.raises(KeyboardInterrupt):
        dump(tmp_path, 4, fail_save=True)
    assert (tmp_path / "recover" / "step4.tmp").is_dir()
    stub, info = load(tmp_path)
    assert info.global_step == 3 and stub.version == 3
    dump(tmp_path, 4)
    assert sorted(p.name for p in (tmp_path / "recover").iterdir()) == ["step3", "step4"]
    dump(tmp_path, 5)  # keep_last=2
    assert sorted(p.name for p in (tmp_path / "recover").iterdir()) == ["step4", "step5"]


def test_a_crash_while_a_point_is_replaced_leaves_the_older_one_loadable(tmp_path, caplog):
    """``megarl convert-point`` writes a point again in place: killed between moving the older one aside and
    moving the new one in, the older one is found and put back (not lost behind a ``.old`` name)."""
    dump(tmp_path, 3)
    dump(tmp_path, 4)
    root = tmp_path / "recover"
    shutil.copytree(root / "step4", root / "step4.tmp")
    (root / "step4").rename(root / "step4.old")  # publish_dir's first rename, then the crash
    stub, info = load(tmp_path)
    assert info.global_step == 4 and stub.loaded_from == str(root / "step4" / "model")
    assert "step4 was being replaced when the run stopped" in caplog.text
    shutil.copytree(root / "step4", root / "step4.old")  # a crash after the second rename
    assert load(tmp_path)[1].global_step == 4
    assert not (root / "step4.old").exists()


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda point: (point / "MANIFEST.json").unlink(), "has no MANIFEST.json"),
        (lambda point: (point / "model" / "version").unlink(), "model/version is missing"),
        (lambda point: (point / "model" / "version").write_text(""), "model/version has 0 bytes, 1 were written"),
        (lambda point: (point / "MANIFEST.json").write_text("{"), "MANIFEST.json is unreadable"),
    ],
    ids=["no-manifest", "file-missing", "file-truncated", "manifest-garbled"],
)
def test_an_incomplete_point_is_skipped_for_the_one_before(tmp_path, caplog, damage, reason):
    dump(tmp_path, 3)
    dump(tmp_path, 4)
    root = tmp_path / "recover"
    damage(root / "step4")
    stub, info = load(tmp_path)
    assert info.global_step == 3 and stub.loaded_from == str(root / "step3" / "model")
    assert f"recover point {root / 'step4'} is incomplete" in caplog.text and reason in caplog.text
    damage(root / "step3")
    with pytest.raises(FileNotFoundError, match=r"no complete recover point: only incomplete ones \(step4, step3\)"):
        load(tmp_path, "resume")
    assert load(tmp_path, "auto")[1] is None  # auto starts fresh


def test_a_full_disk_fails_the_dump_and_keeps_the_previous_point(tmp_path, monkeypatch):
    dump(tmp_path, 3)
    real_save = torch.save

    def disk_full(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(
        OSError,
        match=r"no space left .* recover point step4: the partial dump was removed; "
        r"the previous points are intact \(step3\)",
    ):
        dump(tmp_path, 4)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "recover").iterdir()) == ["step3"]
    assert load(tmp_path)[1].global_step == 3


def test_frequency_and_disabled_mode_decide_whether_to_dump(tmp_path):
    handler, stub = RecoverHandler(RecoverConfig(mode="auto", freq_steps=2), tmp_path), StubEngine()
    assert [handler.maybe_dump(stub, info_at(step)) for step in range(4)] == [False, True, False, True]
    assert [p.name for p in handler.points()] == ["step3", "step1"]
    disabled = RecoverHandler(RecoverConfig(mode="disabled", freq_steps=1), tmp_path / "other")
    assert not disabled.maybe_dump(stub, info_at(0), force=True)
    assert not (tmp_path / "other").exists()


def test_a_second_dump_of_the_same_step_is_skipped(tmp_path):
    handler, stub = RecoverHandler(RecoverConfig(mode="auto", freq_steps=1), tmp_path), StubEngine()
    assert handler.maybe_dump(stub, info_at(3))
    assert not handler.maybe_dump(stub, info_at(3), force=True)  # e.g. a final forced dump after the periodic one
    assert handler.maybe_dump(stub, info_at(4))


def test_modes_on_load(tmp_path, caplog):
    assert load(tmp_path, "auto")[1] is None
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "recover")):
        load(tmp_path, "resume")
    dump(tmp_path, 2)
    assert load(tmp_path, "resume")[1].global_step == 2
    stub, info = load(tmp_path, "disabled")
    assert info is None and stub.loaded_from is None
    assert "ignoring the recover point" in caplog.text


def test_recover_state_restores_the_dump_frequency(tmp_path):
    handler, stub = RecoverHandler(RecoverConfig(mode="auto", freq_steps=3), tmp_path), StubEngine()
    assert handler.maybe_dump(stub, info_at(0), force=True)
    handler.maybe_dump(stub, info_at(1))  # one step counted after the dump
    resumed = RecoverHandler(RecoverConfig(mode="auto", freq_steps=3), tmp_path)
    resumed.load(StubEngine())
    assert [resumed.maybe_dump(stub, info_at(s)) for s in (1, 2, 3)] == [False, False, True]


def test_rng_restored_on_the_same_layout_only(tmp_path):
    dump(tmp_path, 1)
    expected = draws()
    load(tmp_path)
    assert draws() == expected
    load(tmp_path, rank=1, dp=2)  # DP 1 -> 2: rank 1 takes rank 0's info, keeps its own RNG
    assert draws() != expected
    load(tmp_path, rank=0, tp=2)  # the same rank 0 at another layout: its RNG belongs to another coordinate
    assert draws() != expected


def test_another_layout_loads_and_shares_the_prompts_in_flight(tmp_path):
    """At another layout every rank takes rank 0's position; the prompts in flight at the dump are dealt
    out over the new data-parallel heads, each once, and non-head ranks get none."""
    stub = StubEngine()
    stub.version = 4
    info = RecoverInfo(0, 4, 4, 4, dataloader_state={"epoch": 0, "yielded": 20}, extra={"pending_items": list("abcde")})
    RecoverHandler(RecoverConfig(mode="auto"), tmp_path).maybe_dump(stub, info, force=True)
    got = {}
    for rank, share, layout in ((0, (0, 2), {"dp": 2}), (1, (1, 2), {"dp": 2}), (1, None, {"tp": 2})):
        stub = StubEngine(rank=rank, **layout)
        got[rank, share] = RecoverHandler(RecoverConfig(mode="auto"), tmp_path).load(stub, share=share)
        assert stub.version == 4 and got[rank, share].dataloader_state == {"epoch": 0, "yielded": 20}
    assert got[0, (0, 2)].extra["pending_items"] == ["a", "c", "e"]
    assert got[1, (1, 2)].extra["pending_items"] == ["b", "d"]
    assert got[1, None].extra["pending_items"] == []
    same = RecoverHandler(RecoverConfig(mode="auto"), tmp_path).load(StubEngine(), share=(0, 1))
    assert same.extra["pending_items"] == list("abcde")


def test_a_critic_is_dumped_and_loaded_beside_the_actor(tmp_path):
    """PPO's critic has its own checkpoint in the recover point; a run with a critic refuses a point without one."""
    handler = RecoverHandler(RecoverConfig(mode="auto"), tmp_path)
    actor, critic = StubEngine(), StubEngine()
    actor.version, critic.version = 3, 7
    assert handler.maybe_dump({"model": actor, "critic": critic}, info_at(3), force=True)
    actor_back, critic_back = StubEngine(), StubEngine()
    info = RecoverHandler(RecoverConfig(mode="auto"), tmp_path).load({"model": actor_back, "critic": critic_back})
    assert info.global_step == 3 and (actor_back.version, critic_back.version) == (3, 7)
    assert critic_back.loaded_from == str(tmp_path / "recover" / "step3" / "critic")
    dump(tmp_path / "grpo", 2)  # a run without a critic
    with pytest.raises(FileNotFoundError, match="no critic/ checkpoint"):
        RecoverHandler(RecoverConfig(mode="auto"), tmp_path / "grpo").load(
            {"model": StubEngine(), "critic": StubEngine()}
        )


# ---------------------------------------------------------------------------------- checked before the run


def dump_a_point(model_dir: str, run_dir: str, alloc: str, checkpoint_layout: str) -> None:
    """A step, then a recover point, at ``alloc``."""
    from tests.actor.workers import _ckpt_engine, _step, make_batch

    engine = _ckpt_engine(model_dir, alloc, "float32", checkpoint_layout)
    _step(engine, make_batch([7, 12, 5, 9]))
    RecoverHandler(RecoverConfig(mode="auto"), Path(run_dir)).maybe_dump(engine, info_at(0), force=True)


@pytest.mark.multiproc
@pytest.mark.parametrize("checkpoint_layout", ["data_parallel", "any"])
def test_the_config_check_says_what_the_recover_point_cannot_load(tiny_model_dir, tmp_path, checkpoint_layout):
    """``megarl config`` / ``megarl run`` read the point a resume would load, before any server starts: per-rank
    optimizer shards at another pipeline size are refused naming allocation_mode, another model naming actor.path,
    adapters it was not trained with actor.lora; another data-parallel size, or the shards written per parameter,
    pass."""
    from megarl.config.experiment import GRPOConfig
    from megarl.run.prelaunch import load_expr_config
    from megarl.utils.errors import ConfigError

    model = str(tiny_model_dir("llama"))
    run_ranks(
        2,
        "tests.run.test_recover:dump_a_point",
        model_dir=model,
        run_dir=str(tmp_path / "gsm8k-grpo-cpu" / "trial0"),
        alloc="d1p2t1",
        checkpoint_layout=checkpoint_layout,
    )

    def check(trainer: str, path: str = model, *more: str) -> None:
        ranks = AllocationMode.from_str(f"vllm:d1t1+megatron:{trainer}").train.world_size
        overrides = [f"cluster.fileroot={tmp_path}", f"actor.path={path}", "recover.mode=resume", *more]
        overrides += [f"allocation_mode=vllm:d1t1+megatron:{trainer}", f"cluster.n_gpus_per_node={1 + ranks}"]
        load_expr_config(["--config", "configs/gsm8k_grpo_cpu.yaml", *overrides], GRPOConfig)

    check("d1p2t1")
    check("d2p2t1")  # another data-parallel size
    if checkpoint_layout == "any":
        check("d2p1t1")
    else:
        with pytest.raises(ConfigError, match=r"per-rank shards .* layout differs \(pp 2 -> 1\)") as err:
            check("d2p1t1")
        assert err.value.key == "allocation_mode" and "actor.optimizer.checkpoint_layout" in err.value.related
    with pytest.raises(ConfigError, match=r"another model than this engine's \(intermediate_size \d+ -> 96\)") as err:
        check("d1p2t1", str(tiny_model_dir("llama", intermediate_size=96)))
    assert err.value.key == "actor.path"
    with pytest.raises(ConfigError, match=r"another model than this engine's \(lora None -> \{'rank': 8") as err:
        check("d1p2t1", model, "actor.lora.rank=8")  # the same model, adapters it was not trained with
    assert err.value.key == "actor.lora"


def test_the_config_check_refuses_a_run_that_ends_before_its_recover_point(tmp_path):
    """Resuming after step 3 a run of 3 steps would train nothing and write step 3's weights as its last
    checkpoint (step 2's): refused, naming total_train_steps (4 steps, nothing left to train, pass: the
    multi-process check above resumes its step-0 point)."""
    from megarl.config.experiment import GRPOConfig
    from megarl.run.prelaunch import load_expr_config
    from megarl.utils.errors import ConfigError

    dump(tmp_path / "arithmetic-grpo-cpu" / "trial0", 3)
    base = ["--config", "configs/arithmetic_grpo_cpu.yaml", f"cluster.fileroot={tmp_path}", "recover.mode=resume"]
    with pytest.raises(ConfigError, match=r"recover point .*step3 is after step 3 .* total_train_steps=5") as err:
        load_expr_config([*base, "total_train_steps=3"], GRPOConfig)
    assert err.value.key == "total_train_steps"
