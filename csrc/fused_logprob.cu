// Fused token logprob + entropy over a vocab-parallel LM head, without materialising the
// [T, V] logits: forward = tiled GEMM + online logsumexp epilogue (the training path's variant
// also stores the tile's logits for its token chunk); backward = the same GEMM
// recomputing logit tiles + a softmax-gradient epilogue writing a bf16 dz chunk [T, Vc]
// (the two gradient GEMMs dH = dz.W and dW = dz^T.H then run on cuBLAS, per vocab chunk).
//
// This is the sm_80 mainloop (mma.sync, tile_gemm_sm80.cuh); fused_logprob_sm90.cu has the
// Hopper one. The per-token arithmetic both share is in softmax_stats.cuh.
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>

#include "cta_order.cuh"
#include "host_emulation.h"
#include "kernels.h"
#include "softmax_stats.cuh"
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
      const int row = m0 + tile_row(wm, lane, mi, half);
      // value i of this row: fragment ni = i / 2, column j = i % 2
      fold_row<2 * NI>(
          st[mi][half], [&](int i) { return acc.v[mi][i / 2][2 * half + i % 2]; },
          [&](int i) { return n0 + tile_col(wn, lane, i / 2, i % 2); }, valid_v, inv_tau,
          label[mi][half], row < T ? label_logit + row : nullptr, n0, BN);
    }
  }
}

// The training path's copy of a tile: its raw logits (fp32, before the temperature) at
// logits[row * ld + v] for the valid rows and columns, as column pairs (ld even).
__device__ __forceinline__ void store_tile(const Acc& acc, int n0, int valid_v, int m0, int T,
                                           float* logits, int ld) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wm = (warp >> 1) * WM;
  const int wn = (warp & 1) * WN;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + tile_row(wm, lane, mi, half);
      if (row >= T) continue;
      float* out = logits + static_cast<size_t>(row) * ld;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int v = n0 + tile_col(wn, lane, ni, 0);  // even; v + 1 is the pair's second column
        const float x0 = acc.v[mi][ni][2 * half], x1 = acc.v[mi][ni][2 * half + 1];
        if (v + 1 < valid_v) {
          *reinterpret_cast<float2*>(out + v) = make_float2(x0, x1);
        } else if (v < valid_v) {
          out[v] = x0;
        }
      }
    }
  }
}

// One CTA per (vocab split, token block), ordered by grouped_grid (cta_order.cuh); split x owns
// vocab tiles [x * tiles_per_split, ...).
// kStore: also write each tile's raw logits (store_tile), for the training path.
template <bool kStore>
__global__ void __launch_bounds__(THREADS)
    logprob_forward_kernel(const __nv_bfloat16* __restrict__ hidden,  // [T,H]
                           const __nv_bfloat16* __restrict__ weight,  // [V,H]
                           const int64_t* __restrict__ labels,        // [T]
                           int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                           int tiles_per_split,
                           float* __restrict__ part,         // [3, S, T]
                           float* __restrict__ label_logit,  // [T]
                           float* __restrict__ logits,       // [T, ld] when kStore
                           int ld) {
  MEGARL_DYNAMIC_SMEM(smem_raw);
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wm = (warp >> 1) * WM;
  const int split = grouped_col();
  const int num_splits = gridDim.y;
  const int m0 = grouped_row() * BM;
  if (m0 >= T) return;  // the last group's CTAs past the last token block

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
    if constexpr (kStore) store_tile(acc, n0, valid_v, m0, T, logits, ld);
    fold_tile(st, label, acc, n0, valid_v, inv_tau, m0, T, label_logit);
  }

  // The 4 lanes of a quad hold the same rows (different columns).
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) st[mi][half] = quad_merge(st[mi][half]);

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

// One CTA per (vocab tile of the column range, token block), ordered by grouped_grid.
__global__ void __launch_bounds__(THREADS)
    logprob_backward_dz_kernel(const __nv_bfloat16* __restrict__ hidden,  // [T,H]
                               const __nv_bfloat16* __restrict__ weight,  // [V,H]
                               const int64_t* __restrict__ labels,        // [T]
                               int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                               const float* __restrict__ lse,     // [T]
                               const float* __restrict__ mean_z,  // [T]
                               const float* __restrict__ g_lp,    // [T]
                               const float* __restrict__ g_ent,   // [T]
                               const float* __restrict__ theta,   // [T] or null: no truncation
                               int col_begin, int col_count,
                               __nv_bfloat16* __restrict__ dz,  // [T, ld]
                               int ld) {
  MEGARL_DYNAMIC_SMEM(smem_raw);
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wm = (warp >> 1) * WM;
  const int wn = (warp & 1) * WN;
  const int m0 = grouped_row() * BM;
  const int n0 = col_begin + grouped_col() * BN;
  if (m0 >= T) return;
  const int col_end = col_begin + col_count;

  Acc acc;
  tile::gemm_tile(acc, smem, hidden, weight, m0, T, n0, min(col_end, valid_v), H);

#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + tile_row(wm, lane, mi, half);
      if (row >= T) continue;
      const RowGrad r{lse[row], mean_z[row], g_lp[row], g_ent[row], labels[row] - vocab_start,
                      row_theta(theta, row)};
      __nv_bfloat16* out = dz + static_cast<size_t>(row) * ld;
      with_truncation(theta, [&](auto truncated) {
        constexpr bool kTrunc = decltype(truncated)::value;
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const int v = n0 + tile_col(wn, lane, ni, 0);  // even; v + 1 is the pair's second column
          if (v >= col_end) continue;
          float g[2];
#pragma unroll
          for (int j = 0; j < 2; ++j)
            g[j] = softmax_grad<kTrunc>(acc.v[mi][ni][2 * half + j], v + j, r, valid_v, inv_tau);
          if (v + 1 < col_end) {
            *reinterpret_cast<__nv_bfloat162*>(out + (v - col_begin)) =
                __floats2bfloat162_rn(g[0], g[1]);
          } else {
            out[v - col_begin] = __float2bfloat16_rn(g[0]);
          }
        }
      });
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
                                   float* logits, int ld, int cta_group, cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  if (H % 8 != 0 || num_splits <= 0 || cta_group <= 0) return cudaErrorInvalidValue;
  if (logits != nullptr && (ld % 2 != 0 || ld < valid_v)) return cudaErrorInvalidValue;
  const auto kernel = logits != nullptr ? logprob_forward_kernel<true> : logprob_forward_kernel<false>;
  cudaError_t err = set_smem(reinterpret_cast<const void*>(kernel));
  if (err != cudaSuccess) return err;
  const int num_tiles = (valid_v + BN - 1) / BN;
  const int tiles_per_split = (num_tiles + num_splits - 1) / num_splits;
  const dim3 grid = grouped_grid(num_splits, (T + BM - 1) / BM, cta_group);
  MEGARL_LAUNCH(kernel, grid, THREADS, tile::SMEM_BYTES, stream)(
      static_cast<const __nv_bfloat16*>(hidden), static_cast<const __nv_bfloat16*>(weight), labels,
      T, H, valid_v, vocab_start, inv_tau, tiles_per_split, part, label_logit, logits, ld);
  return cudaGetLastError();
}

cudaError_t launch_logprob_backward_dz(const void* hidden, const void* weight, const int64_t* labels,
                                       int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                                       const float* lse, const float* mean_z, const float* g_lp,
                                       const float* g_ent, const float* theta, int col_begin,
                                       int col_count, void* dz, int ld, int cta_group,
                                       cudaStream_t stream) {
  if (T <= 0 || col_count <= 0) return cudaSuccess;
  if (H % 8 != 0 || col_begin % 2 != 0 || ld % 2 != 0 || ld < col_count || cta_group <= 0)
    return cudaErrorInvalidValue;
  cudaError_t err = set_smem(reinterpret_cast<const void*>(&logprob_backward_dz_kernel));
  if (err != cudaSuccess) return err;
  const dim3 grid = grouped_grid((col_count + BN - 1) / BN, (T + BM - 1) / BM, cta_group);
  MEGARL_LAUNCH(logprob_backward_dz_kernel, grid, THREADS, tile::SMEM_BYTES, stream)(
      static_cast<const __nv_bfloat16*>(hidden), static_cast<const __nv_bfloat16*>(weight), labels,
      T, H, valid_v, vocab_start, inv_tau, lse, mean_z, g_lp, g_ent, theta, col_begin, col_count,
      static_cast<__nv_bfloat16*>(dz), ld);
  return cudaGetLastError();
}

}  // namespace megarl
