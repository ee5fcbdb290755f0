"""``use_fused_kernels``: how the flag resolves, where the engine's heads and the PPO loss dispatch,
and that the fused-surrogate path of ``ppo_loss`` gives the pure path's loss, gradients and stats.

The CUDA kernels cannot run on CPU: availability is faked by replacing the extension loader
(``megarl.kernels._cuda.load_extension``); the fused surrogate's wiring in the actor is checked
by forcing it onto ``fused_ppo_loss``'s torch path.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from megarl.actor import ppo_loss
from megarl.actor.fused_ppo_loss import ppo_loss_backend
from megarl.actor.lm_head import LMHeadOutput
from megarl.config.ppo import PPOActorConfig
from megarl.kernels import _cuda, logprobs_backend, resolve_backend
from megarl.kernels.selfcheck import CheckResult
from megarl.utils import stats_tracker
from tests.actor.dist_utils import run_ranks
from tests.actor.workers import engine_config, make_batch

# ---------------------------------------------------------------- how the flag resolves


def _verified(path: str, *failed: str) -> _cuda.KernelPath:
    checks = [CheckResult(m, error="training dz off by up to 0.1, 9 times its tolerance") for m in failed]
    passed = None if path == "torch" else CheckResult(path, 1e-6, "dz", 0.01)
    return _cuda.KernelPath(path, passed, tuple(checks))


@pytest.fixture
def kernels_built(monkeypatch):
    """The extension loads, and on the (current) GPU its sm80 mainloop passes the self-check."""
    monkeypatch.setattr(_cuda, "load_extension", lambda: SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_cuda, "verified_path", lambda device: _verified("sm80"))


@pytest.fixture
def kernels_missing(monkeypatch):
    monkeypatch.setattr(_cuda, "load_extension", lambda: None)
    monkeypatch.delenv("MEGARL_DISABLE_CUDA_KERNELS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _no_probe():
    raise AssertionError("use_fused_kernels=None / False must not load (or JIT-build) the extension")


def test_none_is_auto_and_false_is_torch_without_probing(monkeypatch):
    monkeypatch.setattr(_cuda, "load_extension", _no_probe)
    assert resolve_backend(None, torch.bfloat16, 64) == "auto"
    assert resolve_backend(False, torch.bfloat16, 64) == "torch"
    assert resolve_backend(False, torch.float32, 12) == "torch"


def test_true_is_cuda_where_the_kernels_load(kernels_built):
    assert resolve_backend(True, torch.bfloat16, 64) == "cuda"


def test_true_without_the_kernels_names_the_flag_and_the_reason(kernels_missing):
    with pytest.raises(ValueError, match=r"use_fused_kernels=True .*no CUDA device is available"):
        resolve_backend(True, torch.bfloat16, 64)


def test_true_refuses_a_gpu_where_no_mainloop_passes_its_self_check(kernels_built, monkeypatch):
    monkeypatch.setattr(_cuda, "verified_path", lambda device: _verified("torch", "sm90", "sm80"))
    with pytest.raises(ValueError, match=r"use_fused_kernels=True .*sm80 failed its self-check: training dz"):
        resolve_backend(True, torch.bfloat16, 64)


@pytest.mark.parametrize(
    "dtype, hidden, match", [(torch.float32, 64, "bf16 weights"), (torch.bfloat16, 12, "divisible by 8, got 12")]
)
def test_true_rejects_what_the_kernels_cannot_serve(kernels_built, dtype, hidden, match):
    with pytest.raises(ValueError, match=rf"use_fused_kernels=True .*{match}"):
        resolve_backend(True, dtype, hidden)


def test_auto_takes_torch_for_cpu_tensors_even_where_the_kernels_load(kernels_built):
    hidden, weight = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(10, 64, dtype=torch.bfloat16)
    assert logprobs_backend("auto", hidden, weight) == "torch"
    assert ppo_loss_backend("auto", torch.zeros(4)) == "torch"
    assert logprobs_backend("torch", hidden, weight) == ppo_loss_backend("torch", torch.zeros(4)) == "torch"


def _head(backend="auto", tokens=40, hidden=16, vocab=50, device="cpu", dtype=torch.float32) -> LMHeadOutput:
    g = torch.Generator().manual_seed(0)
    return LMHeadOutput(
        hidden=torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_(True),
        weight=(torch.randn(vocab, hidden, generator=g) * 0.5).to(device, dtype).requires_grad_(True),
        vocab_start=0,
        vocab_size=vocab,
        tp_group=None,
        reduce_grad_hidden=True,
        backend=backend,
    )


def test_head_threads_its_backend_into_the_kernel():
    labels = torch.arange(40) % 50
    torch.testing.assert_close(_head("torch").logprobs(labels), _head("auto").logprobs(labels))
    with pytest.raises(ValueError, match="backend='cuda'"):
        _head("cuda").logprobs(labels)


def test_true_fails_at_engine_initialize_on_this_machine(tiny_model_dir):
    if _cuda.load_extension() is not None:
        pytest.skip("the CUDA kernels load on this machine")
    from megarl.actor.engine import MegatronEngine, training_allocation

    cfg = engine_config(str(tiny_model_dir("llama")), dtype="bfloat16")
    cfg.use_fused_kernels = True
    engine = MegatronEngine(cfg)
    # the check runs before any model is built, so no process groups are needed to reach it
    with pytest.raises(ValueError, match=r"use_fused_kernels=True but the fused CUDA kernels cannot run"):
        engine.initialize(parallel=SimpleNamespace(alloc=training_allocation("d1p1t1")))
    assert engine.model == []


# ---------------------------------------------------------------- fused surrogate == pure surrogate


def _micro_batch(head: LMHeadOutput, seed=1) -> dict:
    """A packed micro-batch of 4 sequences whose old / proximal logprobs stray from the head's,
    far enough on some tokens for the clips, the dual clip and the behaviour cap to bind."""
    g = torch.Generator().manual_seed(seed)
    tokens = head.hidden.shape[0]
    labels = torch.randint(0, head.vocab_size, (tokens,), generator=g)
    with torch.no_grad():
        logp = head.logprobs(labels)
    prox = logp + 0.3 * torch.randn(tokens, generator=g)
    prox[::5] -= 1.0
    old = prox + 0.2 * torch.randn(tokens, generator=g)
    old[::7] -= 1.5
    return {
        "labels": labels,
        "label_mask": torch.rand(tokens, generator=g) > 0.1,
        "loss_mask": (torch.rand(tokens, generator=g) > 0.2).int(),
        "logprobs": old,
        "prox_logp": prox,
        "ref_logp": logp + 0.1 * torch.randn(tokens, generator=g),
        "advantages": torch.randn(tokens, generator=g),
        "cu_seqlens": torch.tensor([0, 9, 20, 31, tokens]),
    }


LOSS_CONFIGS = {
    "asymmetric-clip": {"eps_clip_higher": 0.28, "use_decoupled_loss": False},
    "dual-clip": {"c_clip": 2.0, "use_decoupled_loss": False},
    "decoupled-cap": {"behav_imp_weight_cap": 1.2},
    "all+kl+entropy": {
        "eps_clip_higher": 0.3,
        "c_clip": 2.0,
        "behav_imp_weight_cap": 1.2,
        "kl_ctl": 0.1,
        "entropy_coeff": 0.01,
    },
}


def _run_ppo_loss(cfg: PPOActorConfig, mb: dict, **head_kw) -> tuple:
    head = _head(**head_kw)
    loss = ppo_loss.ppo_loss(head, mb, cfg, norm_len=64)
    loss.backward()
    return loss.detach(), head.hidden.grad, head.weight.grad, stats_tracker.export(local=True)


@pytest.mark.parametrize("overrides", LOSS_CONFIGS.values(), ids=LOSS_CONFIGS.keys())
def test_fused_surrogate_path_matches_policy_loss(monkeypatch, overrides):
    cfg = PPOActorConfig(path="unused", **overrides)
    mb = _micro_batch(_head())
    stats_tracker.export(local=True)  # start from an empty tracker
    pure = _run_ppo_loss(cfg, mb)
    monkeypatch.setattr(ppo_loss, "_fused_surrogate", lambda *args: True)  # fused_ppo_loss, on its torch path
    fused = _run_ppo_loss(cfg, mb)
    for got, want in zip(fused[:3], pure[:3]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert fused[3].keys() == pure[3].keys()
    for key, want in pure[3].items():
        # the epilogue reports clip / cap fractions, not per-token flags: only their averages compare
        if key.rsplit("/", 1)[-1] in ("min", "max") and "_ratio/" in key:
            continue
        assert fused[3][key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    if "c_clip" in overrides:
        assert pure[3]["dual_clip_ratio/avg"] > 0
    if "behav_imp_weight_cap" in overrides:
        assert pure[3]["capped_ratio/avg"] > 0
    assert pure[3]["clip_ratio/avg"] > 0


TRAINING_PATH_CONFIGS = {
    **LOSS_CONFIGS,
    "prox-from-update": {"recompute_logprob": True, "entropy_coeff": 0.02},
    "seq-mean-token-mean": {"loss_agg_mode": "seq-mean-token-mean", "kl_ctl": 0.1, "kl_estimator": "k3"},
    "dr-grpo": {"loss_agg_mode": "seq-mean-token-sum-norm", "entropy_coeff": 0.01},
    # truncation replay: the threshold from each chunk's logits; labels outside the kept set counted
    "truncation": {"top_p": 0.8, "top_k": 5, "kl_ctl": 0.1, "entropy_coeff": 0.01},
}


@pytest.mark.parametrize("overrides", TRAINING_PATH_CONFIGS.values(), ids=TRAINING_PATH_CONFIGS.keys())
def test_training_path_matches_the_logprobs_then_loss_path(monkeypatch, overrides):
    """Gradients made in the head's forward (on its torch path here) == autograd through the loss."""
    cfg = PPOActorConfig(path="unused", **overrides)
    mb = _micro_batch(_head())
    if overrides.get("recompute_logprob"):
        del mb["prox_logp"]  # the proximal policy is this forward's own (prox_from_update)
    stats_tracker.export(local=True)
    pure = _run_ppo_loss(cfg, mb)
    monkeypatch.setattr(ppo_loss, "_grads_in_forward", lambda *args: True)
    monkeypatch.setattr(ppo_loss, "_loss_of_logprobs", _counted(ppo_loss._loss_of_logprobs))
    trained = _run_ppo_loss(cfg, mb)
    assert ppo_loss._loss_of_logprobs.calls == 1  # the statistics, from the detached logprobs
    for name, got, want in zip(("loss", "grad_hidden", "grad_weight"), trained[:3], pure[:3]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert trained[3].keys() == pure[3].keys()
    for key, want in pure[3].items():
        assert trained[3][key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    if "top_k" in overrides:  # uniform labels: most lie outside the top 5, each counted
        assert trained[3]["truncation/label_outside/avg"] > 0.5


def _counted(fn):
    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        return fn(*args, **kwargs)

    wrapper.calls = 0
    return wrapper


@pytest.mark.parametrize(
    "overrides, taken",
    [
        ({}, True),
        ({"importance_sampling_level": "sequence"}, False),
        ({"loss": "my.module.loss"}, False),
        ({"loss_agg_mode": "seq-mean-token-mean"}, True),
    ],
)
def test_training_path_for_per_token_losses_on_either_head_path(monkeypatch, overrides, taken):
    cfg = PPOActorConfig(path="unused", **overrides)
    assert ppo_loss._grads_in_forward(cfg, _head()) is taken  # CPU: the head's torch path
    monkeypatch.setattr(ppo_loss, "logprobs_backend", lambda backend, hidden, weight: "cuda")  # as on a GPU
    assert ppo_loss._grads_in_forward(cfg, _head()) is taken


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overrides", LOSS_CONFIGS.values(), ids=LOSS_CONFIGS.keys())
def test_cuda_epilogue_matches_policy_loss_on_gpu(monkeypatch, overrides):
    assert _cuda.load_extension() is not None, "megarl._C neither prebuilt nor JIT-buildable on this GPU machine"
    cfg = PPOActorConfig(path="unused", **overrides)
    head_kw = {"hidden": 64, "device": "cuda", "dtype": torch.bfloat16}
    mb = {k: v.cuda() for k, v in _micro_batch(_head(hidden=64)).items()}
    assert ppo_loss._fused_surrogate(cfg, _head(**head_kw), mb["logprobs"])
    stats_tracker.export(local=True)
    fused = _run_ppo_loss(cfg, mb, **head_kw)
    monkeypatch.setattr(ppo_loss, "_fused_surrogate", lambda *args: False)
    pure = _run_ppo_loss(cfg, mb, **head_kw)
    torch.testing.assert_close(fused[0], pure[0], atol=1e-5, rtol=1e-4)
    for got, want in zip(fused[1:3], pure[1:3]):  # bf16 gradients
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    for key in ("clip_ratio/avg", "dual_clip_ratio/avg", "capped_ratio/avg", "importance_weight/avg"):
        assert fused[3][key] == pytest.approx(pure[3][key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize(
    "overrides", [{"importance_sampling_level": "sequence"}, {"loss_agg_mode": "seq-mean-token-mean"}]
)
def test_fused_surrogate_only_for_what_the_epilogue_implements(monkeypatch, overrides):
    monkeypatch.setattr(ppo_loss, "ppo_loss_backend", lambda backend, logp: "cuda")  # as on a GPU
    assert ppo_loss._fused_surrogate(PPOActorConfig(path="unused"), _head(), torch.zeros(4))
    assert not ppo_loss._fused_surrogate(PPOActorConfig(path="unused", **overrides), _head(), torch.zeros(4))


# ---------------------------------------------------------------- a real actor: False == None on CPU


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.add(record.getMessage())


def ppo_step_with_flag(model_dir: str, batch: dict, use_fused_kernels: bool | None) -> dict:
    """Rank function: one MegatronPPOActor step under the flag, and the kernel paths ppo_loss logged."""
    from tests.actor.workers import ppo_actor_step

    records, start = _Records(), _Records()
    logger = logging.getLogger(ppo_loss.__name__)
    logger.setLevel(logging.DEBUG)
    logger.addHandler(records)
    engine_logger = logging.getLogger("megarl.actor.engine")
    engine_logger.setLevel(logging.INFO)
    engine_logger.addHandler(start)
    result = ppo_actor_step(model_dir, "d1p1t1", batch, use_fused_kernels=use_fused_kernels)
    kernels = {m for m in start.messages if m.startswith("fused kernels: ")}
    return {"stats": result["stats"], "logp_after": result["logp_after"], "paths": records.messages, "start": kernels}


@pytest.mark.multiproc
def test_actor_update_is_the_same_with_flag_false_and_none_on_cpu(tiny_model_dir):
    batch = make_batch([7, 12, 5, 9, 11, 6, 8, 10], seed=1)
    model_dir = str(tiny_model_dir("llama"))
    target = "tests.actor.test_fused_flag:ppo_step_with_flag"
    runs = {
        flag: run_ranks(1, target, model_dir=model_dir, batch=batch, use_fused_kernels=flag)[0]
        for flag in (False, None)
    }
    torch_paths = {  # the loss through the head's training path; its statistics from the torch logprobs
        "ppo_loss: training path (grads in the head's forward), surrogate via losses.policy_loss",
        "ppo_loss: logprobs on the torch path, surrogate via losses.policy_loss",
    }
    assert runs[False]["paths"] == runs[None]["paths"] == torch_paths
    # the start line and the metric say which path runs
    assert runs[False]["start"] == {"fused kernels: torch (use_fused_kernels=False)"}
    assert runs[None]["start"] == {"fused kernels: torch (no CUDA device is available)"}
    assert all(step["ppo_actor/fused_kernel_path"] == 0.0 for run in runs.values() for step in run["stats"])
    assert len(runs[None]["stats"]) == 2  # two mini-batches
    for want, got in zip(runs[False]["stats"], runs[None]["stats"]):
        assert got["ppo_actor/loss"] == want["ppo_actor/loss"]
        assert got["ppo_actor/grad_norm"] == want["ppo_actor/grad_norm"] > 0
    assert torch.equal(runs[None]["logp_after"], runs[False]["logp_after"])
