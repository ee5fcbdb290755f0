// The training path's second kernel: the softmax gradient of a token chunk whose logits the
// storing forward (launch_logprob_forward with a logits buffer) left in memory. Once the
// chunk's statistics are merged over the vocab splits and the TP group and the loss has given
// dL/dlogprob and dL/dentropy per token, one elementwise pass turns the stored fp32 logits
// into the bf16 dz that the two gradient GEMMs (cuBLAS) read: no logit is computed twice, so
// the whole training step over the LM head costs 6·T·V·H FLOPs. The arithmetic is the
// backward kernels' (softmax_stats.cuh, softmax_grad), with the same optional per-token
// truncation threshold.
#include <cstdint>

#include <cuda_bf16.h>

#include "host_emulation.h"
#include "kernels.h"
#include "softmax_stats.cuh"

namespace megarl {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRowBlocks = 4096;  // grid.y; rows beyond it are taken by a grid-stride loop
constexpr int kMaxColumnBlocks = 32;

// grid = (column blocks, row blocks); each thread takes column pairs (v, v + 1) of a row.
__global__ void __launch_bounds__(kThreads)
    softmax_grad_stored_kernel(const float* __restrict__ logits, int ld_logits,  // [T, ld_logits]
                               const int64_t* __restrict__ labels, int T, int valid_v,
                               int64_t vocab_start, float inv_tau,
                               const float* __restrict__ lse, const float* __restrict__ mean_z,
                               const float* __restrict__ g_lp, const float* __restrict__ g_ent,
                               const float* __restrict__ theta,  // [T] or null
                               __nv_bfloat16* __restrict__ dz, int ld_dz) {  // [T, ld_dz]
  const int pairs = (valid_v + 1) / 2;
  for (int row = blockIdx.y; row < T; row += gridDim.y) {
    const RowGrad r{lse[row], mean_z[row], g_lp[row], g_ent[row], labels[row] - vocab_start,
                    row_theta(theta, row)};
    const float* in = logits + static_cast<size_t>(row) * ld_logits;
    __nv_bfloat16* out = dz + static_cast<size_t>(row) * ld_dz;
    with_truncation(theta, [&](auto truncated) {
      constexpr bool kTrunc = decltype(truncated)::value;
      for (int p = blockIdx.x * kThreads + threadIdx.x; p < pairs; p += gridDim.x * kThreads) {
        const int v = 2 * p;
        if (v + 1 < valid_v) {
          const float2 x = *reinterpret_cast<const float2*>(in + v);
          *reinterpret_cast<__nv_bfloat162*>(out + v) =
              __floats2bfloat162_rn(softmax_grad<kTrunc>(x.x, v, r, valid_v, inv_tau),
                                    softmax_grad<kTrunc>(x.y, v + 1, r, valid_v, inv_tau));
        } else {
          out[v] = __float2bfloat16_rn(softmax_grad<kTrunc>(in[v], v, r, valid_v, inv_tau));
        }
      }
    });
  }
}

}  // namespace

cudaError_t launch_softmax_grad_stored(const float* logits, int ld_logits, const int64_t* labels,
                                       int T, int valid_v, int64_t vocab_start, float inv_tau,
                                       const float* lse, const float* mean_z, const float* g_lp,
                                       const float* g_ent, const float* theta, void* dz, int ld_dz,
                                       cudaStream_t stream) {
  if (T <= 0 || valid_v <= 0) return cudaSuccess;
  if (ld_logits % 2 != 0 || ld_dz % 2 != 0 || ld_logits < valid_v || ld_dz < valid_v)
    return cudaErrorInvalidValue;
  const int pairs = (valid_v + 1) / 2;
  const int column_blocks = (pairs + kThreads - 1) / kThreads;
  const dim3 grid(column_blocks < kMaxColumnBlocks ? column_blocks : kMaxColumnBlocks,
                  T < kMaxRowBlocks ? T : kMaxRowBlocks);
  MEGARL_LAUNCH(softmax_grad_stored_kernel, grid, kThreads, 0, stream)(
      logits, ld_logits, labels, T, valid_v, vocab_start, inv_tau, lse, mean_z, g_lp, g_ent, theta,
      static_cast<__nv_bfloat16*>(dz), ld_dz);
  return cudaGetLastError();
}

}  // namespace megarl
