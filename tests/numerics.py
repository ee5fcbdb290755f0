"""Tolerances derived from floating-point error analysis, not from what one CPU happened to give.

A sum of ``n`` terms computed in a dtype with unit roundoff ``u`` (``torch.finfo(dtype).eps / 2``)
is within ``gamma(n) * sum(|terms|)`` of the exact sum, ``gamma(n) = n u / (1 - n u)``, in any
order of summation (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1).
CPUs differ exactly there: AVX2, AVX-512 and AMX kernels block and order a matrix product's sums
differently, so a tolerance tuned on one CPU fails on another, while this bound holds on all.

A test computes the exact value in float64, the sums of ``|terms|`` from the same operands, and
checks the dtype's result with :func:`assert_within`. :func:`softmax_head_bounds` is the bound of
the fused logprob head (logprob, entropy and both gradients), which several kernel tests check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: the largest relative error of rounding one real number to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """gamma_n = n u / (1 - n u): a sum of n terms is within gamma_n * sum(|terms|) of exact."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"a reduction of {n} terms in {dtype} has no error bound (n u = {nu:.2f} >= 1)")
    return nu / (1 - nu)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> float:
    """Assert |got - want| <= bound elementwise (``want`` exact or float64); returns the largest
    |got - want| / bound, for reporting how much of the bound a result used."""
    diff = (got.double() - want.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    over = diff > bound
    ratio = float((diff / bound.clamp_min(torch.finfo(torch.float64).tiny)).max()) if diff.numel() else 0.0
    if over.any():
        worst = int((diff - bound).argmax())
        raise AssertionError(
            f"{what}: {int(over.sum())} of {diff.numel()} elements beyond their error bound; worst "
            f"|diff| {diff.flatten()[worst]:.3e} where the bound is {bound.flatten()[worst]:.3e} "
            f"(largest diff / bound: {ratio:.2f})"
        )
    return ratio


@dataclass
class HeadBounds:
    """Per-element error bounds of the fused head's outputs against the exact values."""

    logprob: torch.Tensor  # [T]
    entropy: torch.Tensor  # [T]
    d_hidden: torch.Tensor  # [T, H]
    d_weight: torch.Tensor  # [V, H]
    lse: torch.Tensor  # [T]: log-sum-exp of the logits

    def __mul__(self, factor: float) -> HeadBounds:
        fields = ("logprob", "entropy", "d_hidden", "d_weight", "lse")
        return HeadBounds(*(getattr(self, f) * factor for f in fields))


def softmax_head_bounds(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    coefs: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    kept: torch.Tensor | None = None,
    coef_errors: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> HeadBounds:
    """First-order error bounds of logprob, entropy and the gradients of
    ``sum(coefs[0] * logprob + coefs[1] * entropy)`` computed in ``dtype`` from
    ``z = hidden @ weight.T / temperature`` (softmax over the ``kept`` [T, V] tokens, all by default).
    A label outside ``[0, V)`` is ignored: its logprob is 0 and exact, and it has no gradient.
    ``coef_errors``: bounds of the per-token ``coefs`` themselves, where the loss is nonlinear in
    logprob and entropy and its derivatives are computed in ``dtype`` from them.

    Each step's bound, in the exact (float64) quantities, with E_x the bound of x:
      logits   E_z[t,j] = gamma(H+1) (|h_t| . |w_j|) / tau              (H products summed, one division)
      lse      E_lse[t] = max_j E_z + 2u max_j |z| + gamma(V+8)          (exps of shifted logits summed;
                                                                           chunk merges, exp and log: 8 roundings)
      p        |dp_j| <= p_j (E_z_j + E_lse)
      logprob  E_z[t,label] + E_lse + u |logprob|
      mean z   E_mu = sum_j p_j (E_z_j + |z_j| (E_z_j + E_lse)) + gamma(V) sum_j p_j |z_j|
      entropy  E_lse + E_mu + u |entropy|
      g = dL/dz / tau, g_tj = (c0 (onehot - p_j) - c1 p_j (z_j - mu)) / tau, and
      |dg_tj| <= (|c0| |dp_j| + |c1| (|dp_j| |z_j - mu| + p_j (E_z_j + E_mu))) / tau + 4u |g_tj|
               (+ (E_c0 |onehot - p_j| + E_c1 p_j |z_j - mu|) / tau with ``coef_errors``)
      d_hidden = g @ W:   |dg| @ |W| + gamma(V) |g| @ |W|;   d_weight = g^T @ H: |dg|^T @ |H| + gamma(T) |g|^T @ |H|
    Second-order terms (products of two bounds) are left out: each is below u times its first-order term.
    """
    h, w = hidden.double(), weight.double()
    T, H = h.shape
    V = w.shape[0]
    u = unit_roundoff(dtype)
    kept = torch.ones(T, V, dtype=torch.bool) if kept is None else kept
    z = h @ w.T / temperature
    e_z = gamma(H + 1, dtype) * (h.abs() @ w.abs().T) / temperature
    zk = z.masked_fill(~kept, float("-inf"))
    p = zk.softmax(dim=-1)
    z0 = z.masked_fill(~kept, 0.0)
    e_zk = e_z.masked_fill(~kept, 0.0)
    e_lse = e_zk.amax(dim=-1) + 2 * u * z0.abs().amax(dim=-1) + gamma(V + 8, dtype)
    dp = p * (e_zk + e_lse[:, None])
    hit = (labels >= 0) & (labels < V)
    labels = labels.clamp(0, V - 1)
    logp = torch.log_softmax(zk, dim=-1).gather(1, labels[:, None]).squeeze(1) * hit
    mu = (p * z0).sum(dim=-1)
    e_mu = (p * (e_zk + z0.abs() * (e_zk + e_lse[:, None]))).sum(dim=-1) + gamma(V, dtype) * (p * z0.abs()).sum(-1)
    entropy = torch.logsumexp(zk, dim=-1) - mu
    c0, c1 = coefs[0].double()[:, None] * hit[:, None], coefs[1].double()[:, None]
    onehot = torch.zeros(T, V, dtype=torch.float64).scatter_(1, labels[:, None], hit[:, None].double())
    g = (c0 * (onehot - p) - c1 * p * (z0 - mu[:, None])) / temperature
    dg = (c0.abs() * dp + c1.abs() * (dp * (z0 - mu[:, None]).abs() + p * (e_zk + e_mu[:, None]))) / temperature
    dg = dg + 4 * u * g.abs()
    if coef_errors is not None:
        e_c0, e_c1 = (e.double()[:, None] for e in coef_errors)
        dg = dg + (e_c0 * hit[:, None] * (onehot - p).abs() + e_c1 * p * (z0 - mu[:, None]).abs()) / temperature
    return HeadBounds(
        logprob=(e_z.gather(1, labels[:, None]).squeeze(1) + e_lse + u * logp.abs()) * hit,
        entropy=e_lse + e_mu + u * entropy.abs(),
        d_hidden=dg @ w.abs() + gamma(V, dtype) * (g.abs() @ w.abs()),
        d_weight=dg.T @ h.abs() + gamma(T, dtype) * (g.abs().T @ h.abs()),
        lse=e_lse + u * torch.logsumexp(zk, dim=-1).abs(),
    )


PPO_TOKEN_ROUNDINGS = 8
"""Roundings in one token's PPO loss: the log-ratio subtractions, two exps (ratio and behaviour weight),
the clip's bounds, the products with the advantage and the weight."""


def ppo_token_relative_error(
    logp: torch.Tensor,
    old: torch.Tensor,
    prox: torch.Tensor | None,
    dtype: torch.dtype,
    inputs_rounded: bool = False,
    fast_exp: bool = False,
) -> torch.Tensor:
    """The relative error bound of each token's PPO loss computed in ``dtype`` (see :func:`ppo_loss_bounds`);
    ``inputs_rounded``: the log-probabilities themselves were rounded to ``dtype`` from exact values (a
    hand-computed example's ``math.log(0.6)``), each adding u times its magnitude to the log-ratio;
    ``fast_exp``: the ratio and the behaviour weight come from CUDA's ``__expf`` (the kernel), whose error
    :func:`fast_exp_relative_error` bounds, instead of a correctly rounded exp."""
    anchor = old if prox is None else prox
    logs = [logp.double(), old.double()] + ([] if prox is None else [prox.double()])
    exponents = [logs[0] - anchor.double()] + ([] if prox is None else [prox.double() - old.double()])
    rel = PPO_TOKEN_ROUNDINGS + sum(x.abs() for x in exponents)
    if inputs_rounded:
        rel = rel + sum(x.abs() for x in logs) + (0 if prox is None else prox.double().abs() + old.double().abs())
    rel = rel * unit_roundoff(dtype)
    if fast_exp:
        rel = rel + sum(fast_exp_relative_error(x, dtype) for x in exponents)
    return rel


def ppo_loss_bounds(
    loss_tok: torch.Tensor,
    grad_tok: torch.Tensor,
    logp: torch.Tensor,
    old: torch.Tensor,
    prox: torch.Tensor | None,
    mask: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[float, torch.Tensor]:
    """Bounds of a token-mean PPO loss computed in ``dtype`` and of its gradient per token, against the
    exact ``loss_tok`` / ``grad_tok`` (float64: the per-token loss, and d(mean loss)/d logp).

    A token's log-ratio x = logp - anchor is rounded once (|dx| <= u |x|) and exp turns that into a
    relative error |x| u of the ratio; with a proximal policy the behaviour weight exp(prox - old) adds
    its own. Each token is then within ``(PPO_TOKEN_ROUNDINGS + |x| + |x_w|) u`` of its exact value,
    relative; the mean adds gamma(n) sum|loss| over the n tokens kept, divided by their (exact) count.
    A token on a clip boundary within these errors could fall on either side: the caller's data keep
    clear of that (the clip fractions are compared exactly)."""
    u = unit_roundoff(dtype)
    rel = ppo_token_relative_error(logp, old, prox, dtype) * mask
    count = max(int(mask.sum()), 1)
    loss_bound = float(((rel * loss_tok.abs()).sum() + gamma(count, dtype) * loss_tok.abs().sum()) / count)
    return loss_bound, (rel + u) * grad_tok.abs()


def fast_exp_relative_error(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Relative error bound of ``exp(x)`` in the kernels of ``csrc/`` (built with ``--use_fast_math``):
    CUDA documents ``__expf`` within 2 + floor(|1.173 x|) ulp (``exp2f`` as ``ex2.approx``: 2 ulp), and
    an ulp is at most 2u relative. A correctly rounded exp (the host emulation's, torch's) is within u."""
    return (2 + 1.173 * x.double().abs()) * 2 * unit_roundoff(dtype)


@dataclass
class PartialBounds:
    """Bounds of a softmax triple (m = max z, s = sum exp(z - m), u = sum exp(z - m)(z - m)) over a
    range of logits, against the exact values."""

    m: torch.Tensor
    s: torch.Tensor
    u: torch.Tensor


def softmax_partial_bounds(z: torch.Tensor, e_z: torch.Tensor, merges: int, dtype: torch.dtype) -> PartialBounds:
    """Error bounds of the triple over the last dim of the exact logits ``z`` [T, n] computed in ``dtype``
    from logits each within ``e_z`` of ``z``, with at most ``merges`` merges of partial triples on any
    term's way (softmax_stats.cuh: a tile's fold, the quad's shuffles, the warps', the tiles' of a split).

      m        E_m = max_j E_z_j                           (a max of computed logits: no rounding of its own)
      d = z-m  E_d_j = E_z_j + E_m + u (2|z_j| + |m| + |d_j|)  (the fast path forms (z - m) log2 e by one FMA
                                                            from the raw logit and -m log2 e: cancellation)
      e = e^d  E_e_j = e_j (E_d_j + fast_exp_relative_error(d_j) + u)
      s        sum_j E_e_j + gamma(n + 4 merges + 8) s + 4 merges u |u|   (a merge rescales a part by
                                                            exp(m_a - m), whose argument and fast-exp error
                                                            grow with |m_a - m| <= |d_j| of its every term)
      u        sum_j (E_e_j |d_j| + e_j E_d_j) + gamma(n + 4 merges + 8) |u| + (4 merges + 8) u sum_j e_j d_j^2
    Every term of u has the sign of d_j <= 0, so its sums and merges do not cancel. An empty range is
    (-inf, 0, 0) exactly: bounds 0."""
    T, n = z.shape
    if n == 0:
        zeros = z.new_zeros(T)
        return PartialBounds(zeros, zeros, zeros)
    u_ = unit_roundoff(dtype)
    m = z.amax(dim=1, keepdim=True)
    e_m = e_z.amax(dim=1, keepdim=True)
    d = z - m
    e_d = e_z + e_m + u_ * (2 * z.abs() + m.abs() + d.abs())
    e = d.exp()
    e_e = e * (e_d + fast_exp_relative_error(d, dtype) + u_)
    u_stat = (e * d).sum(dim=1)
    g = gamma(n + 4 * merges + 8, dtype)
    s = e.sum(dim=1)
    return PartialBounds(
        m=e_m.squeeze(1),
        s=e_e.sum(dim=1) + g * s + 4 * merges * u_ * u_stat.abs(),
        u=(e_e * d.abs() + e * e_d).sum(dim=1) + g * u_stat.abs() + (4 * merges + 8) * u_ * (e * d * d).sum(dim=1),
    )


@dataclass
class StatsBounds:
    """Bounds of each token's finalised softmax statistics (``megarl.kernels.reference.finalize_stats``)
    against the exact values, each ``[T]``."""

    lse: torch.Tensor
    mean_z: torch.Tensor
    logprob: torch.Tensor
    entropy: torch.Tensor


def softmax_stats_bounds(
    z: torch.Tensor,
    e_z: torch.Tensor,
    labels: torch.Tensor,
    merges: int,
    dtype: torch.dtype,
    kept: torch.Tensor | None = None,
) -> StatsBounds:
    """Bounds of (lse, mean_z, logprob, entropy) that ``finalize_stats`` computes in ``dtype`` from a
    triple (m, s, u) over each row's ``kept`` logits (all by default) within :func:`softmax_partial_bounds`
    (``merges`` merges of partial triples on any term's way; CUDA's ``__expf`` or a correctly rounded exp)
    of the exact triple of ``z`` [T, V], and from a label logit within ``e_z`` of its exact value. A label
    outside ``[0, V)`` is ignored: its logprob is 0 and exact. With E_m, E_s, E_u the triple's bounds:

      log s      E_ls  = E_s / s + 2u |log s|                 (log within one ulp)
      lse        E_lse = E_m + E_ls + u |lse|                 (lse = m + log s)
      u / s      E_ms  = E_u / s + |u| E_s / s^2 + u |u / s|
      entropy    E_ls + E_ms + u |entropy|                    (entropy = log s - u / s)
      mean_z     E_m + E_ms + u |mean_z|                      (mean_z = m + u / s)
      logprob    e_z[label] + E_lse + u |logprob|             (logprob = label logit - lse)

    The error of m, which cancels from lse to first order, is counted both in E_m and in E_s: a bound,
    not the tightest one. Second-order terms (products of two bounds) are left out."""
    T, V = z.shape
    z, e_z = z.double(), e_z.double()
    u = unit_roundoff(dtype)
    if kept is None:
        part = softmax_partial_bounds(z, e_z, merges, dtype)
        e_m, e_s, e_u = part.m, part.s, part.u
        kept = torch.ones(T, V, dtype=torch.bool)
    else:
        rows = [softmax_partial_bounds(z[t : t + 1, kept[t]], e_z[t : t + 1, kept[t]], merges, dtype) for t in range(T)]
        e_m, e_s, e_u = (torch.cat([getattr(r, f) for r in rows]) for f in "msu")
    zk = z.masked_fill(~kept, float("-inf"))
    m = zk.amax(dim=1)
    d = (z - m[:, None]).masked_fill(~kept, 0.0)
    e = torch.where(kept, d.exp(), 0.0)
    s, u_stat = e.sum(dim=1), (e * d).sum(dim=1)
    log_s = s.log()
    lse, mean_s = m + log_s, u_stat / s
    hit = (labels >= 0) & (labels < V)
    label_logit = z.gather(1, labels.clamp(0, V - 1)[:, None]).squeeze(1)
    logprob = torch.where(hit, label_logit - lse, 0.0)
    e_ls = e_s / s + 2 * u * log_s.abs()
    e_lse = e_m + e_ls + u * lse.abs()
    e_ms = e_u / s + u_stat.abs() * e_s / s**2 + u * mean_s.abs()
    e_label = e_z.gather(1, labels.clamp(0, V - 1)[:, None]).squeeze(1)
    return StatsBounds(
        lse=e_lse,
        mean_z=e_m + e_ms + u * (m + mean_s).abs(),
        logprob=torch.where(hit, e_label + e_lse + u * logprob.abs(), 0.0),
        entropy=e_ls + e_ms + u * (log_s - mean_s).abs(),
    )


def _column(x) -> torch.Tensor | float:
    """A per-token vector [T] as a column [T, 1] (float64); a number as it is."""
    return x.double()[:, None] if isinstance(x, torch.Tensor) else x


def softmax_grad_bound(
    z: torch.Tensor,
    e_z: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor,
    onehot: torch.Tensor,
    inv_tau: float,
    *,
    e_lse: torch.Tensor | float = 0.0,
    e_mean_z: torch.Tensor | float = 0.0,
    e_g_lp: torch.Tensor | float = 0.0,
    e_g_ent: torch.Tensor | float = 0.0,
    kept: torch.Tensor | None = None,
    fast_exp: bool = True,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Bound [T, V] of dz = dL/dx = (g_lp (onehot - p) - g_ent p (z - mean_z)) inv_tau, p = exp(z - lse)
    on each row's ``kept`` logits and 0 on the others (the softmax gradient of ``softmax_stats.cuh`` and of
    ``megarl.kernels.reference.softmax_grad_``), computed in fp32 from logits within ``e_z`` of ``z`` and
    per-token inputs within ``e_*`` of the exact ``[T]`` vectors (0: exact fp32 inputs), then rounded to
    ``out_dtype``. With u = fp32's unit roundoff:

      p          E_p = p (E_z + E_lse + u |z - lse| + exp error)    (fast_exp: fast_exp_relative_error, CUDA's
                                                                     ``__expf``; else u, a correctly rounded exp)
      a          E_a = E_p + u |a|,  a = onehot - p
      b          E_b = E_z + E_mean_z + u |b|,  b = z - mean_z
      dz         inv_tau (|g_lp| E_a + E_g_lp |a| + |g_ent| (E_p |b| + p E_b) + E_g_ent p |b|)
                 + 5u inv_tau (|g_lp| (onehot + p) + |g_ent| p |b|)
      rounded    + u_out (|dz| + E)                               (out_dtype coarser than fp32: bf16 dz)

    Each term of dz passes at most five roundings in either order of the arithmetic: the kernels'
    (g_lp a - g_ent p b) inv_tau, and the torch path's g_lp onehot - p (g_lp + g_ent b) with inv_tau applied
    to it or in the gradient GEMM. A dropped token (p = 0) is taken to be dropped by the computed logits too:
    the caller's data keep every logit more than its error away from the threshold. Second-order terms
    are left out."""
    z, e_z, onehot = z.double(), e_z.double(), onehot.double()
    lse, mean_z, g_lp, g_ent = (_column(x) for x in (lse, mean_z, g_lp, g_ent))
    e_lse, e_mean_z, e_g_lp, e_g_ent = (_column(x) for x in (e_lse, e_mean_z, e_g_lp, e_g_ent))
    u = unit_roundoff(torch.float32)
    p = (z - lse).exp()
    if kept is not None:
        p = torch.where(kept, p, 0.0)
    exp_error = fast_exp_relative_error(z - lse) if fast_exp else u
    e_p = p * (e_z + e_lse + u * (z - lse).abs() + exp_error)
    a, b = onehot - p, z - mean_z
    e_a, e_b = e_p + u * a.abs(), e_z + e_mean_z + u * b.abs()
    bound = inv_tau * (
        g_lp.abs() * e_a + e_g_lp * a.abs() + g_ent.abs() * (e_p * b.abs() + p * e_b) + e_g_ent * p * b.abs()
    )
    bound = bound + 5 * u * inv_tau * (g_lp.abs() * (onehot + p) + g_ent.abs() * p * b.abs())
    u_out = unit_roundoff(out_dtype)
    if u_out > u:
        bound = bound + u_out * (inv_tau * (g_lp * a - g_ent * p * b).abs() + bound)
    return bound


def matmul_bound(
    a: torch.Tensor,
    e_a: torch.Tensor,
    b: torch.Tensor,
    extra_roundings: int = 0,
    low_roundings: int = 0,
    dtype: torch.dtype = torch.float32,
    low_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Bound [m, n] of A @ B computed in ``dtype`` from an A' within ``e_a`` of the exact A [m, k] and the
    exact B [k, n] (bf16 operands, exact in fp32):

      |A' - A| |B| + gamma(k + extra_roundings) (|A| + e_a) |B| + low_roundings u_low (|A| + e_a) |B|

    The k products summed in ``dtype`` are within gamma_k of their sum in any order and blocking of the
    sum (the chunks of a chunked GEMM, a CPU's kernel); ``extra_roundings``: further roundings that every
    term passes (a scale factor such as 1/tau applied in the GEMM, a sum over the ranks of a TP group);
    ``low_roundings``: roundings of partial or final results to ``low_dtype`` on any term's way (torch's
    bf16 matmul on a CPU returns bf16 per chunk, a gradient stored in a bf16 parameter): rounding the
    partial sums P_c of disjoint sets of terms costs sum_c u_low |P_c| <= u_low (|A| + e_a) |B| in all."""
    a, e_a, b = a.double(), e_a.double(), b.double().abs()
    magnitude = (a.abs() + e_a) @ b
    k = a.shape[-1]
    return e_a @ b + (gamma(k + extra_roundings, dtype) + low_roundings * unit_roundoff(low_dtype)) * magnitude
