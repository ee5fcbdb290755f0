// PPO / GRPO clipped-surrogate epilogue: one pass over the per-token logprobs that yields the
// per-token loss, its analytic gradient wrt the logprobs and the clipping statistics. It runs
// on [T] vectors that the fused logprob kernel produced, so there is no further pass over [T, V].
//
// Per masked token (AReaL's decoupled PPO when prox is given):
//   r  = exp(logp - prox)            (prox = old when not given)
//   l1 = -A r,  l2 = -A clip(r, 1 - eps_low, 1 + eps_high),  pg = max(l1, l2)
//   dual clip (c > 1): pg = min(pg, c |A|)            -- binds only for A < 0
//   w  = exp(prox - old), 0 where w > cap             (1 when prox is not given)
//   loss_tok = w pg,  d loss_tok / d logp = w r (-A) when neither clip binds, else 0.
#include <cmath>
#include <cstdint>

#include "host_emulation.h"
#include "kernels.h"

namespace megarl {
namespace {

constexpr int kThreads = 256;

struct TokenOut {
  float loss;
  float grad;
  float ratio;
  float kl;
  float behav;
  bool clipped;
  bool dual;
  bool capped;
};

__device__ __forceinline__ TokenOut ppo_token(float logp, float old, const float* prox_ptr,
                                              int64_t t, float adv, float eps_low, float eps_high,
                                              float dual_clip, float behav_cap) {
  TokenOut o{};
  const float denorm = prox_ptr ? prox_ptr[t] : old;
  o.kl = logp - denorm;
  o.ratio = __expf(o.kl);
  const float clipped_ratio = fminf(fmaxf(o.ratio, 1.f - eps_low), 1.f + eps_high);
  const float l1 = -adv * o.ratio;
  const float l2 = -adv * clipped_ratio;
  o.clipped = l1 < l2;
  float pg = o.clipped ? l2 : l1;
  float dpg = o.clipped ? 0.f : -adv * o.ratio;  // d pg / d logp = d pg / d r * r
  if (dual_clip > 0.f) {
    const float l3 = dual_clip * fabsf(adv);
    o.dual = l3 < pg;
    if (o.dual) {
      pg = l3;
      dpg = 0.f;
    }
  }
  o.behav = 1.f;
  if (prox_ptr) {
    o.behav = __expf(denorm - old);
    o.capped = behav_cap > 0.f && !(o.behav <= behav_cap);
    if (o.capped) o.behav = 0.f;
  }
  o.loss = o.behav * pg;
  o.grad = o.behav * dpg;
  return o;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float warp_min(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__global__ void __launch_bounds__(kThreads)
    ppo_loss_kernel(const float* __restrict__ logp, const float* __restrict__ old_logp,
                    const float* __restrict__ prox_logp, const float* __restrict__ adv,
                    const bool* __restrict__ mask, int64_t T, float eps_low, float eps_high,
                    float dual_clip, float behav_cap, float* __restrict__ loss_tok,
                    float* __restrict__ grad_tok, float* __restrict__ stats) {
  // Per-thread partial statistics, in the order of PPOStat up to kStatBehavCapped.
  float acc[kStatBehavCapped + 1] = {};
  float rmax = 0.f;
  float rmin = INFINITY;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < T; t += stride) {
    if (!mask[t]) {
      loss_tok[t] = 0.f;
      grad_tok[t] = 0.f;
      continue;
    }
    const TokenOut o = ppo_token(logp[t], old_logp[t], prox_logp, t, adv[t], eps_low, eps_high,
                                 dual_clip, behav_cap);
    loss_tok[t] = o.loss;
    grad_tok[t] = o.grad;
    acc[kStatCount] += 1.f;
    acc[kStatClipped] += o.clipped ? 1.f : 0.f;
    acc[kStatDualClipped] += o.dual ? 1.f : 0.f;
    acc[kStatRatioSum] += o.ratio;
    acc[kStatKLSum] += o.kl;
    acc[kStatBehavSum] += o.behav;
    acc[kStatBehavCapped] += o.capped ? 1.f : 0.f;
    rmax = fmaxf(rmax, o.ratio);
    rmin = fminf(rmin, o.ratio);
  }

  __shared__ float red[kThreads / 32][kNumPPOStats];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i <= kStatBehavCapped; ++i) acc[i] = warp_sum(acc[i]);
  rmax = warp_max(rmax);
  rmin = warp_min(rmin);
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i <= kStatBehavCapped; ++i) red[warp][i] = acc[i];
    red[warp][kStatRatioMax] = rmax;
    red[warp][kStatRatioMin] = rmin;
  }
  __syncthreads();
  if (threadIdx.x < kNumPPOStats) {
    const int i = threadIdx.x;
    float v = red[0][i];
    for (int w = 1; w < kThreads / 32; ++w) {
      const float x = red[w][i];
      v = i == kStatRatioMax ? fmaxf(v, x) : i == kStatRatioMin ? fminf(v, x) : v + x;
    }
    // Ratios are >= 0 (or +inf), where IEEE order equals signed-int order of the bits.
    if (i == kStatRatioMax) {
      atomicMax(reinterpret_cast<int*>(stats + i), __float_as_int(v));
    } else if (i == kStatRatioMin) {
      atomicMin(reinterpret_cast<int*>(stats + i), __float_as_int(v));
    } else {
      atomicAdd(stats + i, v);
    }
  }
}

}  // namespace

cudaError_t launch_ppo_loss(const float* logp, const float* old_logp, const float* prox_logp,
                            const float* adv, const bool* mask, int64_t T, float eps_low,
                            float eps_high, float dual_clip, float behav_cap, float* loss_tok,
                            float* grad_tok, float* stats, cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  // A few tokens per thread keeps the number of atomics per statistic small.
  const int64_t blocks = (T + kThreads * 4 - 1) / (kThreads * 4);
  const int grid = static_cast<int>(blocks < 1024 ? blocks : 1024);
  MEGARL_LAUNCH(ppo_loss_kernel, grid, kThreads, 0, stream)(logp, old_logp, prox_logp, adv, mask,
                                                            T, eps_low, eps_high, dual_clip,
                                                            behav_cap, loss_tok, grad_tok, stats);
  return cudaGetLastError();
}

}  // namespace megarl
