// Fused token logprob + entropy over a vocab-parallel LM head, without materialising the
// [T, V] logits: forward = tiled GEMM + online logsumexp epilogue; backward = the same GEMM
// recomputing logit tiles + a softmax-gradient epilogue writing a bf16 dz chunk [T, Vc]
// (the two gradient GEMMs dH = dz.W and dW = dz^T.H then run on cuBLAS, per vocab chunk).
//
// Per token the forward keeps three running numbers over the vocab it has seen (in units of
// z = logit / temperature): m = max z, s = sum exp(z - m), u = sum exp(z - m) (z - m). Then
// lse = m + log s and entropy = log s - u / s (shifted so that a peaked softmax keeps its
// precision). Two such triples merge exactly, which is what the quad shuffles, the cross-warp
// step, the per-split partials and the cross-TP collectives all do.
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>

#include "host_emulation.h"
#include "kernels.h"
#include "tile_gemm_sm80.cuh"

namespace megarl {
namespace {

using tile::Acc;
using tile::BM;
using tile::BN;
using tile::MI;
using tile::NI;
using tile::THREADS;
using tile::WM;
using tile::WN;

struct Stats {
  float m;  // running max of z
  float s;  // sum exp(z - m)
  float u;  // sum exp(z - m) (z - m)
};

__device__ __forceinline__ Stats empty_stats() { return {-INFINITY, 0.f, 0.f}; }

// Exact merge of two triples; an empty triple (m = -inf) contributes nothing, and the
// (-inf) * 0 products that a naive rescale would produce are never formed.
__device__ __forceinline__ Stats merge(Stats a, Stats b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return a;
  Stats r{m, 0.f, 0.f};
  if (a.m != -INFINITY) {
    const float da = a.m - m;
    const float sa = __expf(da);
    r.s += sa * a.s;
    r.u += sa * (a.u + da * a.s);
  }
  if (b.m != -INFINITY) {
    const float db = b.m - m;
    const float sb = __expf(db);
    r.s += sb * b.s;
    r.u += sb * (b.u + db * b.s);
  }
  return r;
}

__device__ __forceinline__ Stats shfl_xor(Stats x, int mask) {
  return {__shfl_xor_sync(0xffffffffu, x.m, mask), __shfl_xor_sync(0xffffffffu, x.s, mask),
          __shfl_xor_sync(0xffffffffu, x.u, mask)};
}

// Row of the CTA tile that acc.v[mi][*][2*half + j] belongs to, and the column of acc.v[*][ni][e].
__device__ __forceinline__ int tile_row(int wm, int lane, int mi, int half) {
  return wm + mi * 16 + (lane >> 2) + half * 8;
}
__device__ __forceinline__ int tile_col(int wn, int lane, int ni, int j) {
  return wn + ni * 8 + (lane & 3) * 2 + j;
}

// Fold one logit tile into this thread's running stats (16 columns per row per thread) and
// record the label logit when the label column lies in the tile.
__device__ __forceinline__ void fold_tile(Stats (&st)[MI][2], const int (&label)[MI][2],
                                          const Acc& acc, int n0, int valid_v, float inv_tau,
                                          int m0, int T, float* label_logit) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wm = (warp >> 1) * WM;
  const int wn = (warp & 1) * WN;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tmax = -INFINITY;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int v = n0 + tile_col(wn, lane, ni, j);
          if (v < valid_v) tmax = fmaxf(tmax, acc.v[mi][ni][2 * half + j] * inv_tau);
        }
      if (tmax == -INFINITY) continue;  // no valid column of this row in this thread's part
      Stats& s = st[mi][half];
      Stats t{fmaxf(s.m, tmax), 0.f, 0.f};
      const int lbl = label[mi][half];
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int v = n0 + tile_col(wn, lane, ni, j);
          if (v < valid_v) {
            const float z = acc.v[mi][ni][2 * half + j] * inv_tau;
            const float d = z - t.m;
            const float e = __expf(d);
            t.s += e;
            t.u += e * d;
            if (v == lbl) {
              const int row = m0 + tile_row(wm, lane, mi, half);
              if (row < T) label_logit[row] = z;
            }
          }
        }
      s = merge(s, t);
    }
  }
}

// grid = (num_splits, ceil(T / BM)); split x owns vocab tiles [x * tiles_per_split, ...).
__global__ void __launch_bounds__(THREADS)
    logprob_forward_kernel(const __nv_bfloat16* __restrict__ hidden,  // [T,H]
                           const __nv_bfloat16* __restrict__ weight,  // [V,H]
                           const int64_t* __restrict__ labels,        // [T]
                           int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                           int tiles_per_split,
                           float* __restrict__ part,         // [3, S, T]
                           float* __restrict__ label_logit)  // [T]
{
  MEGARL_DYNAMIC_SMEM(smem_raw);
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wm = (warp >> 1) * WM;
  const int split = blockIdx.x;
  const int num_splits = gridDim.x;
  const int m0 = blockIdx.y * BM;

  Stats st[MI][2];
  int label[MI][2];  // label as a row of this shard, -1 when not in its valid rows
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      st[mi][half] = empty_stats();
      const int row = m0 + tile_row(wm, lane, mi, half);
      const int64_t l = row < T ? labels[row] - vocab_start : -1;
      label[mi][half] = (l >= 0 && l < valid_v) ? static_cast<int>(l) : -1;
    }

  const int num_tiles = (valid_v + BN - 1) / BN;
  const int tile_begin = split * tiles_per_split;
  const int tile_end = min(num_tiles, tile_begin + tiles_per_split);
  Acc acc;
  for (int t = tile_begin; t < tile_end; ++t) {
    const int n0 = t * BN;
    tile::gemm_tile(acc, smem, hidden, weight, m0, T, n0, valid_v, H);
    fold_tile(st, label, acc, n0, valid_v, inv_tau, m0, T, label_logit);
  }

  // The 4 lanes of a quad hold the same rows (different columns).
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      st[mi][half] = merge(st[mi][half], shfl_xor(st[mi][half], 1));
      st[mi][half] = merge(st[mi][half], shfl_xor(st[mi][half], 2));
    }

  // The two warps of a warp row hold the same rows (different column halves): merge via smem,
  // which gemm_tile left free behind its final barrier.
  float* red = reinterpret_cast<float*>(smem_raw);  // [2 (wn), BM, 3]
  if ((lane & 3) == 0) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* dst = red + ((warp & 1) * BM + tile_row(wm, lane, mi, half)) * 3;
        dst[0] = st[mi][half].m;
        dst[1] = st[mi][half].s;
        dst[2] = st[mi][half].u;
      }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < BM; r += THREADS) {
    const int row = m0 + r;
    if (row >= T) continue;
    const float* a = red + r * 3;
    const float* b = red + (BM + r) * 3;
    const Stats s = merge({a[0], a[1], a[2]}, {b[0], b[1], b[2]});
    const size_t plane = static_cast<size_t>(num_splits) * T;
    const size_t at = static_cast<size_t>(split) * T + row;
    part[at] = s.m;
    part[plane + at] = s.s;
    part[2 * plane + at] = s.u;
  }
}

// grid = (ceil(col_count / BN), ceil(T / BM)).
__global__ void __launch_bounds__(THREADS)
    logprob_backward_dz_kernel(const __nv_bfloat16* __restrict__ hidden,  // [T,H]
                               const __nv_bfloat16* __restrict__ weight,  // [V,H]
                               const int64_t* __restrict__ labels,        // [T]
                               int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                               const float* __restrict__ lse,     // [T]
                               const float* __restrict__ mean_z,  // [T]
                               const float* __restrict__ g_lp,    // [T]
                               const float* __restrict__ g_ent,   // [T]
                               int col_begin, int col_count,
                               __nv_bfloat16* __restrict__ dz,  // [T, ld]
                               int ld) {
  MEGARL_DYNAMIC_SMEM(smem_raw);
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wm = (warp >> 1) * WM;
  const int wn = (warp & 1) * WN;
  const int m0 = blockIdx.y * BM;
  const int n0 = col_begin + blockIdx.x * BN;
  const int col_end = col_begin + col_count;

  Acc acc;
  tile::gemm_tile(acc, smem, hidden, weight, m0, T, n0, min(col_end, valid_v), H);

#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + tile_row(wm, lane, mi, half);
      if (row >= T) continue;
      const float row_lse = lse[row];
      const float row_mean = mean_z[row];
      const float row_glp = g_lp[row];
      const float row_gent = g_ent[row];
      const int64_t lbl = labels[row] - vocab_start;
      __nv_bfloat16* out = dz + static_cast<size_t>(row) * ld;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int v = n0 + tile_col(wn, lane, ni, 0);  // even; v + 1 is the pair's second column
        if (v >= col_end) continue;
        float g[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float z = acc.v[mi][ni][2 * half + j] * inv_tau;
          const float p = __expf(z - row_lse);
          const float onehot = (v + j == lbl) ? 1.f : 0.f;
          const float dzv = row_glp * (onehot - p) - row_gent * p * (z - row_mean);
          g[j] = (v + j < valid_v) ? dzv * inv_tau : 0.f;
        }
        if (v + 1 < col_end) {
          *reinterpret_cast<__nv_bfloat162*>(out + (v - col_begin)) =
              __floats2bfloat162_rn(g[0], g[1]);
        } else {
          out[v - col_begin] = __float2bfloat16_rn(g[0]);
        }
      }
    }
  }
}

cudaError_t set_smem(const void* kernel) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              tile::SMEM_BYTES);
}

}  // namespace

cudaError_t launch_logprob_forward(const void* hidden, const void* weight, const int64_t* labels,
                                   int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                                   int num_splits, float* part, float* label_logit,
                                   cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  if (H % 8 != 0 || num_splits <= 0) return cudaErrorInvalidValue;
  cudaError_t err = set_smem(reinterpret_cast<const void*>(&logprob_forward_kernel));
  if (err != cudaSuccess) return err;
  const int num_tiles = (valid_v + BN - 1) / BN;
  const int tiles_per_split = (num_tiles + num_splits - 1) / num_splits;
  const dim3 grid(num_splits, (T + BM - 1) / BM);
  MEGARL_LAUNCH(logprob_forward_kernel, grid, THREADS, tile::SMEM_BYTES, stream)(
      static_cast<const __nv_bfloat16*>(hidden), static_cast<const __nv_bfloat16*>(weight), labels,
      T, H, valid_v, vocab_start, inv_tau, tiles_per_split, part, label_logit);
  return cudaGetLastError();
}

cudaError_t launch_logprob_backward_dz(const void* hidden, const void* weight, const int64_t* labels,
                                       int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                                       const float* lse, const float* mean_z, const float* g_lp,
                                       const float* g_ent, int col_begin, int col_count, void* dz,
                                       int ld, cudaStream_t stream) {
  if (T <= 0 || col_count <= 0) return cudaSuccess;
  if (H % 8 != 0 || col_begin % 2 != 0 || ld % 2 != 0 || ld < col_count)
    return cudaErrorInvalidValue;
  cudaError_t err = set_smem(reinterpret_cast<const void*>(&logprob_backward_dz_kernel));
  if (err != cudaSuccess) return err;
  const dim3 grid((col_count + BN - 1) / BN, (T + BM - 1) / BM);
  MEGARL_LAUNCH(logprob_backward_dz_kernel, grid, THREADS, tile::SMEM_BYTES, stream)(
      static_cast<const __nv_bfloat16*>(hidden), static_cast<const __nv_bfloat16*>(weight), labels,
      T, H, valid_v, vocab_start, inv_tau, lse, mean_z, g_lp, g_ent, col_begin, col_count,
      static_cast<__nv_bfloat16*>(dz), ld);
  return cudaGetLastError();
}

}  // namespace megarl
