"""The CUDA kernels against the torch reference (needs a GPU; JIT-builds csrc/ if megarl._C is absent)."""

import pytest
import torch

from megarl.actor.fused_ppo_loss import fused_ppo_loss, ppo_loss_backend
from megarl.kernels import (
    Truncation,
    _cuda,
    fused_logprobs_entropy,
    logprobs_backend,
    resolve_backend,
)
from tests.kernels.conftest import mainloops_to_test

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def ext():
    module = _cuda.load_extension()
    assert module is not None, "megarl._C neither prebuilt nor JIT-buildable on this GPU machine"
    return module


def skip_without_wgmma(ext):
    if not ext.sm90_mainloop_available():
        pytest.skip("the wgmma mainloop needs an sm_90 GPU and an sm_90a build")


@pytest.fixture(params=["sm80", "sm90"])
def mainloop(request, ext, monkeypatch):
    """Each test runs on both mainloops: mma.sync everywhere, TMA + wgmma where the GPU is sm_90;
    only on the one that MEGARL_CUDA_MAINLOOP=sm80|sm90 in the environment forces."""
    if request.param not in mainloops_to_test():
        pytest.skip(f"MEGARL_CUDA_MAINLOOP={mainloops_to_test()[0]} in the environment")
    if request.param == "sm90":
        skip_without_wgmma(ext)
    monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", request.param)
    return request.param


def run(backend, hidden, weight, labels, coefs, **kwargs):
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    logp, ent = fused_logprobs_entropy(hidden, weight, labels, backend=backend, **kwargs)
    (coefs[0] * logp + coefs[1] * ent).sum().backward()
    return logp.detach(), ent.detach(), hidden.grad.float(), weight.grad.float()


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


# (T, H, rows, padding, vocab_start, temperature): token and vocab tails, H with a K tail
# (H % 32 != 0), padded shards, a shard that starts past 0, temperature != 1.
SHAPES = [
    (1, 64, 130, 0, 0, 1.0),
    (130, 200, 1000, 7, 0, 0.7),
    (300, 256, 4096, 0, 4096, 1.3),
    (257, 512, 2311, 11, 0, 1.0),
]


@pytest.mark.parametrize("T,H,rows,pad,start,tau", SHAPES)
def test_logprob_entropy_and_grads_match_reference(mainloop, T, H, rows, pad, start, tau):
    g = torch.Generator(device="cuda").manual_seed(T + H + rows)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(rows, H, device="cuda", generator=g) * H**-0.5 * 4).bfloat16()
    vocab = start + rows - pad
    labels = torch.randint(start - 3, vocab + 3, (T,), device="cuda", generator=g)
    coefs = torch.randn(2, T, device="cuda", generator=g)
    kw = {"temperature": tau, "vocab_start": start, "vocab_size": vocab, "chunk_vocab": 1024}
    got = run("cuda", hidden, weight, labels, coefs, **kw)
    want = run("torch", hidden, weight, labels, coefs, **kw)
    torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(got[1], want[1], atol=2e-3, rtol=1e-3)
    # dz is rounded to bf16 before the gradient GEMMs, as a bf16 autograd graph would
    assert rel_err(got[2], want[2]) < 1e-2
    assert rel_err(got[3], want[3]) < 1e-2
    assert torch.all(got[3][rows - pad :] == 0)


@pytest.mark.parametrize("T,H,rows,pad,start,tau", SHAPES)
def test_training_path_kernels_match_its_torch_ops(mainloop, T, H, rows, pad, start, tau):
    """fused_linear_token_loss on the storing forward + softmax_grad.cu against the same function
    on torch ops (bf16 cuBLAS GEMMs either way)."""
    from megarl.kernels.linear_loss import fused_linear_token_loss

    g = torch.Generator(device="cuda").manual_seed(T + rows)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(rows, H, device="cuda", generator=g) * H**-0.5 * 4).bfloat16()
    vocab = start + rows - pad
    labels = torch.randint(start - 3, vocab + 3, (T,), device="cuda", generator=g)
    coefs = torch.randn(2, T, device="cuda", generator=g)
    results = {}
    for backend in ("cuda", "torch"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, logp, ent = fused_linear_token_loss(
            h,
            w,
            labels,
            lambda t0, t1, lp, e: coefs[0, t0:t1] * lp.exp() + coefs[1, t0:t1] * e,
            temperature=tau,
            vocab_start=start,
            vocab_size=vocab,
            chunk_tokens=128,
            backend=backend,
        )
        loss.backward()
        results[backend] = (loss.detach(), logp, ent, h.grad.float(), w.grad.float())
    got, want = results["cuda"], results["torch"]
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)
    assert rel_err(got[3], want[3]) < 1e-2 and rel_err(got[4], want[4]) < 1e-2
    assert torch.all(got[4][rows - pad :] == 0)


TRUNCATIONS = [Truncation(top_p=0.8, top_k=20), Truncation(min_p=0.1)]


@pytest.mark.parametrize("trunc", TRUNCATIONS, ids=repr)
def test_truncation_on_both_paths_matches_the_torch_ones(mainloop, trunc):
    """Truncation replay on the GPU: the recomputing backward and softmax_grad.cu with the per-token
    threshold against the torch paths (the logprob path's forward is torch on both)."""
    from megarl.kernels.linear_loss import fused_linear_token_loss

    T, H, rows, pad, tau = 257, 256, 2311, 11, 0.7
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(rows, H, device="cuda", generator=g) * H**-0.5 * 4).bfloat16()
    vocab = rows - pad
    z = hidden.float() @ weight[:vocab].float().T / tau
    labels = torch.multinomial(z.softmax(dim=1), 1, generator=g).squeeze(1)  # as sampled (most kept)
    coefs = torch.randn(2, T, device="cuda", generator=g)
    kw = {"temperature": tau, "vocab_size": vocab, "chunk_vocab": 1024, "truncation": trunc}
    got = run("cuda", hidden, weight, labels, coefs, **kw)
    want = run("torch", hidden, weight, labels, coefs, **kw)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)  # the same torch forward
    assert rel_err(got[2], want[2]) < 1e-2 and rel_err(got[3], want[3]) < 1e-2
    full = run("cuda", hidden, weight, labels, coefs, **{**kw, "truncation": None})
    assert rel_err(full[2], got[2]) > 0.2  # the threshold is not ignored (0.38 in fp32 on a CPU)

    results = {}
    for backend in ("cuda", "torch"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, logp, ent = fused_linear_token_loss(
            h,
            w,
            labels,
            lambda t0, t1, lp, e: coefs[0, t0:t1] * lp + coefs[1, t0:t1] * e,
            temperature=tau,
            vocab_size=vocab,
            chunk_tokens=128,
            backend=backend,
            truncation=trunc,
        )
        loss.backward()
        results[backend] = (logp, ent, h.grad.float(), w.grad.float())
    for a, b in zip(results["cuda"][:2], want[:2]):  # against the logprob path
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)
    (_, _, gh, gw), (_, _, wh, ww) = results["cuda"], results["torch"]
    assert rel_err(gh, wh) < 1e-2 and rel_err(gw, ww) < 1e-2
    assert torch.all(gw[vocab:] == 0)


@pytest.mark.parametrize("wgmma", [False, True])
def test_forward_splits_merge_exactly(ext, wgmma):
    """Different split counts (partials merged in torch; 24 leaves some splits empty) give the
    same statistics."""
    if (wanted := "sm90" if wgmma else "sm80") not in mainloops_to_test():
        pytest.skip(f"MEGARL_CUDA_MAINLOOP={mainloops_to_test()[0]} in the environment: no {wanted} launch")
    if wgmma:
        skip_without_wgmma(ext)
    hidden = torch.randn(200, 128, device="cuda").bfloat16()
    weight = torch.randn(3000, 128, device="cuda").bfloat16()
    labels = torch.randint(0, 3000, (200,), device="cuda")
    parts = [ext.logprob_forward(hidden, weight, labels, 2990, 0, 1.0, s, wgmma) for s in (1, 5, 24)]
    from megarl.kernels.reference import merge_stats

    merged = [torch.stack(merge_stats(*p[0])) for p in parts]
    for m, p in zip(merged[1:], parts[1:]):
        torch.testing.assert_close(m, merged[0], atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(p[1], parts[0][1])


@pytest.mark.parametrize("wgmma", [False, True])
def test_the_cta_order_changes_no_result(ext, wgmma):
    """MEGARL_CUDA_CTA_GROUP's orders (1: the column-fastest one; 3 leaves a last group of one token
    block at 7 blocks) give the same bits: forward partials, label logits and the backward's dz."""
    if (wanted := "sm90" if wgmma else "sm80") not in mainloops_to_test():
        pytest.skip(f"MEGARL_CUDA_MAINLOOP={mainloops_to_test()[0]} in the environment: no {wanted} launch")
    if wgmma:
        skip_without_wgmma(ext)
    g = torch.Generator(device="cuda").manual_seed(2)
    T, H, rows, valid = 7 * 128 - 5, 192, 3000, 2990
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(rows, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    labels = torch.randint(0, rows, (T,), device="cuda", generator=g)
    vectors = [torch.randn(T, device="cuda", generator=g) for _ in range(4)]  # lse, mean_z, g_lp, g_ent
    results = []
    for group in (1, 3, 16):
        part, label_logit = ext.logprob_forward(hidden, weight, labels, valid, 0, 1.0, 5, wgmma, cta_group=group)
        dz = torch.full((T, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
        ext.logprob_backward_dz(hidden, weight, labels, valid, 0, 1.0, *vectors, 2, 1000, dz, wgmma, cta_group=group)
        results.append((part, label_logit, dz[:, :1000]))
    for group, got in zip((3, 16), results[1:]):
        for name, a, b in zip(("part", "label_logit", "dz"), got, results[0]):
            assert not a.isnan().any(), f"group {group}: {name} left unwritten"
            assert torch.equal(a, b), f"group {group}: {name} differs from group 1"


def test_mainloops_agree_on_a_model_sized_shape(ext, monkeypatch):
    """sm_80 and sm_90a mainloops on one shape with every tail: same logprobs and gradients."""
    if len(mainloops_to_test()) < 2:
        pytest.skip(f"MEGARL_CUDA_MAINLOOP={mainloops_to_test()[0]} in the environment")
    skip_without_wgmma(ext)
    g = torch.Generator(device="cuda").manual_seed(1)
    T, H, rows = 1000, 1000, 5000
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(rows, H, device="cuda", generator=g) * H**-0.5 * 4).bfloat16()
    labels = torch.randint(0, rows, (T,), device="cuda", generator=g)
    coefs = torch.randn(2, T, device="cuda", generator=g)
    results = {}
    for name in ("sm80", "sm90"):
        monkeypatch.setenv("MEGARL_CUDA_MAINLOOP", name)
        results[name] = run("cuda", hidden, weight, labels, coefs, chunk_vocab=2048)
    for got, want in zip(results["sm90"], results["sm80"]):
        assert rel_err(got, want) < 1e-3


def test_unaligned_operands_are_realigned(mainloop):
    """A view that starts 2 bytes into its storage is copied to an aligned buffer, not misread."""
    hidden = torch.randn(65 * 64 + 1, device="cuda").bfloat16()[1:].view(65, 64)
    weight = torch.randn(300, 64, device="cuda").bfloat16()
    labels = torch.randint(0, 300, (65,), device="cuda")
    got = fused_logprobs_entropy(hidden, weight, labels, backend="cuda")
    want = fused_logprobs_entropy(hidden, weight, labels, backend="torch")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("use_prox", [False, True])
def test_ppo_kernel_matches_torch(ext, use_prox):
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 10_000
    old = -torch.rand(n, device="cuda", generator=g) * 3
    logp = old + 0.4 * torch.randn(n, device="cuda", generator=g)
    prox = old + 0.2 * torch.randn(n, device="cuda", generator=g) if use_prox else None
    adv = torch.randn(n, device="cuda", generator=g)
    mask = torch.rand(n, device="cuda", generator=g) > 0.2
    kw = {"prox_logprobs": prox, "eps_clip": 0.2, "eps_clip_high": 0.28, "dual_clip": 3.0, "behav_imp_weight_cap": 1.2}
    results = []
    for backend in ("cuda", "torch"):
        x = logp.clone().requires_grad_(True)
        loss, stats = fused_ppo_loss(x, old, adv, mask, backend=backend, **kw)
        loss.backward()
        results.append((loss, x.grad, stats))
    (l1, g1, s1), (l2, g2, s2) = results
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g1, g2, atol=1e-7, rtol=1e-4)
    for field in s1.__dataclass_fields__:
        torch.testing.assert_close(getattr(s1, field), getattr(s2, field), atol=1e-5, rtol=1e-4)


def test_auto_and_use_fused_kernels_pick_cuda_on_gpu(ext):
    hidden = torch.randn(4, 64, device="cuda").bfloat16()
    weight = torch.randn(10, 64, device="cuda").bfloat16()
    assert logprobs_backend("auto", hidden, weight) == "cuda"
    assert logprobs_backend("auto", hidden.float(), weight.float()) == "torch"  # the logprob kernel is bf16-only
    assert ppo_loss_backend("auto", torch.zeros(4, device="cuda")) == "cuda"
    assert resolve_backend(True, torch.bfloat16, 64) == "cuda"
