// One 128x128 logit tile, z[BM,BN] = A[BM,K] . B[BN,K]^T, in registers: bf16 operands,
// fp32 accumulation, mma.sync m16n8k16 fed by ldmatrix from a cp.async multistage pipeline.
//
// This is the sm_80 path; it also runs on sm_90a (mma.sync is valid on Hopper, at a lower
// share of peak than wgmma). A wgmma/TMA mainloop is not written yet.
//
// A is the hidden states [M=T, K=H], B the LM-head shard [N=V, K=H]: both row-major with K
// contiguous, which is exactly the "row.col" operand order of mma.sync, so no transposes.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "host_emulation.h"
#include "kernels.h"

namespace megarl {
namespace tile {

constexpr int BM = kTileTokens;
constexpr int BN = kTileVocab;
constexpr int BK = 32;       // K slice per pipeline stage
constexpr int STAGES = 4;    // cp.async stages in flight
constexpr int THREADS = 128; // 4 warps as 2 (M) x 2 (N), each warp owns a 64x64 sub-tile
constexpr int WM = 64;
constexpr int WN = 64;
constexpr int MI = WM / 16;  // m16 fragments per warp
constexpr int NI = WN / 8;   // n8 fragments per warp
// Rows padded by 8 bf16 (80 bytes): the 8 row addresses of one ldmatrix 8x8 matrix then
// fall in 8 distinct 16-byte bank groups, so the loads are conflict-free without a swizzle.
constexpr int SROW = BK + 8;
constexpr int STAGE_ELEMS = (BM + BN) * SROW;
constexpr int SMEM_BYTES = STAGES * STAGE_ELEMS * 2;

static_assert(BM == 2 * WM && BN == 2 * WN, "warp layout is 2x2");
static_assert(BK % 16 == 0, "BK must be a multiple of the mma K (16)");

// acc[mi][ni][e]: row = wm + mi*16 + lane/4 + 8*(e/2), col = wn + ni*8 + 2*(lane%4) + e%2.
struct Acc {
  float v[MI][NI][4];
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_size 0 zero-fills (rows/cols out of range).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
  const int src_size = pred ? 16 : 0;
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::cp_async_cg_shared_global_16(smem_addr(dst), src, src_size);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_size));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::cp_async_commit_group();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::cp_async_wait_group(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::ldmatrix_sync_aligned_m8n8_x4_shared_b16(r, smem_addr(p));
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#endif
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4],
                                               const uint32_t (&b)[2]) {
#ifdef MEGARL_HOST_EMULATION
  const float c[4] = {d[0], d[1], d[2], d[3]};
  cuda_emu::mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(d, a, b, c);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Copy rows [row0, row0+ROWS) x cols [k0, k0+BK) of a row-major [rows, K] bf16 matrix into a
// padded smem tile; rows >= row_limit and cols >= K are zero-filled (K % 8 == 0).
template <int ROWS>
__device__ __forceinline__ void load_tile_async(__nv_bfloat16* dst, const __nv_bfloat16* src,
                                                int row0, int row_limit, int k0, int K) {
  constexpr int CHUNKS = BK / 8;  // 16-byte chunks per row
  static_assert((ROWS * CHUNKS) % THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int j = 0; j < ROWS * CHUNKS / THREADS; ++j) {
    const int i = threadIdx.x + j * THREADS;
    const int r = i / CHUNKS;
    const int c = (i % CHUNKS) * 8;
    const int gr = row0 + r;
    const int gk = k0 + c;
    const bool pred = gr < row_limit && gk < K;
    const __nv_bfloat16* g = pred ? src + static_cast<size_t>(gr) * K + gk : src;
    cp_async16(dst + r * SROW + c, g, pred);
  }
}

__device__ __forceinline__ void load_stage(__nv_bfloat16* stage, const __nv_bfloat16* A,
                                           const __nv_bfloat16* B, int m0, int M, int n0,
                                           int n_limit, int k0, int K) {
  load_tile_async<BM>(stage, A, m0, M, k0, K);
  load_tile_async<BN>(stage + BM * SROW, B, n0, n_limit, k0, K);
}

// Tensor-core work on one smem stage: BK/16 steps of (4 A + 4 B ldmatrix.x4, 32 mma).
__device__ __forceinline__ void compute_stage(Acc& acc, const __nv_bfloat16* stage, int wm, int wn,
                                              int lane) {
  const __nv_bfloat16* sA = stage;
  const __nv_bfloat16* sB = stage + BM * SROW;
#pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    uint32_t a[MI][4];
    uint32_t b[NI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      // matrices 0..3 = (rows +0, k +0), (rows +8, k +0), (rows +0, k +8), (rows +8, k +8)
      const int r = wm + mi * 16 + (lane & 15);
      const int c = kk + (lane >> 4) * 8;
      ldmatrix_x4(a[mi], sA + r * SROW + c);
    }
#pragma unroll
    for (int nj = 0; nj < NI / 2; ++nj) {
      // matrices 0..3 = (n +0, k +0), (n +0, k +8), (n +8, k +0), (n +8, k +8): the b0/b1
      // registers of two consecutive n8 fragments.
      const int r = wn + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
      const int c = kk + ((lane >> 3) & 1) * 8;
      uint32_t t[4];
      ldmatrix_x4(t, sB + r * SROW + c);
      b[2 * nj][0] = t[0];
      b[2 * nj][1] = t[1];
      b[2 * nj + 1][0] = t[2];
      b[2 * nj + 1][1] = t[3];
    }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) mma_bf16_16816(acc.v[mi][ni], a[mi], b[ni]);
    }
  }
}

// acc = A[m0:m0+BM, :K] . B[n0:n0+BN, :K]^T, with A rows >= M and B rows >= n_limit read as 0.
// Ends with a barrier, so the caller may reuse smem right after.
__device__ __forceinline__ void gemm_tile(Acc& acc, __nv_bfloat16* smem, const __nv_bfloat16* A,
                                          const __nv_bfloat16* B, int m0, int M, int n0,
                                          int n_limit, int K) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wm = (warp >> 1) * WM;
  const int wn = (warp & 1) * WN;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc.v[mi][ni][e] = 0.f;

  const int num_k = (K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_k) load_stage(smem + s * STAGE_ELEMS, A, B, m0, M, n0, n_limit, s * BK, K);
    cp_async_commit();  // always commit, so that group counting stays uniform
  }
  for (int kt = 0; kt < num_k; ++kt) {
    cp_async_wait<STAGES - 2>();  // stage kt has landed (for this thread) ...
    __syncthreads();              // ... for all threads, and stage kt-1 is no longer read
    const int next = kt + STAGES - 1;
    if (next < num_k)
      load_stage(smem + (next % STAGES) * STAGE_ELEMS, A, B, m0, M, n0, n_limit, next * BK, K);
    cp_async_commit();
    compute_stage(acc, smem + (kt % STAGES) * STAGE_ELEMS, wm, wn, lane);
  }
  cp_async_wait<0>();
  __syncthreads();
}

}  // namespace tile
}  // namespace megarl
