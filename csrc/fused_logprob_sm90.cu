// Hopper (sm_90a) versions of the fused logprob forward and backward-dz kernels: the same
// contracts as fused_logprob.cu (see kernels.h), on the TMA + wgmma mainloop of
// tile_gemm_sm90.cuh with 128 x 256 logit tiles. The epilogues are the sm_80 ones' arithmetic
// (softmax_stats.cuh) over wgmma's accumulator layout; each token row is held by the 4 lanes
// of one quad, so the forward's final merge is two shuffles.
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cta_order.cuh"
#include "host_emulation.h"
#include "kernels.h"
#include "softmax_stats.cuh"
#include "tile_gemm_sm90.cuh"

namespace megarl {
namespace {

using sm90::BM;
using sm90::BN;
using sm90::Fragment;
using sm90::kAccRegs;

struct ForwardArgs {
  const int64_t* labels;
  int T;
  int valid_v;
  int64_t vocab_start;
  float inv_tau;
  float* part;         // [3, num_splits, T]; the split is grouped_col(), num_splits gridDim.y
  float* label_logit;  // [T]
  float* logits;       // [T, ld] raw logits, written by the storing variant only
  int ld;
};

struct BackwardArgs {
  const int64_t* labels;
  int T;
  int valid_v;
  int64_t vocab_start;
  float inv_tau;
  const float* lse;
  const float* mean_z;
  const float* g_lp;
  const float* g_ent;
  const float* theta;  // [T] truncation thresholds in units of z, or null: none
  int col_begin;
  int col_end;
  __nv_bfloat16* dz;  // [T, ld], column v - col_begin
  int ld;
};

#ifdef MEGARL_SM90A  // the epilogues exist in the sm_90a device pass only

// Online logsumexp/entropy over the tiles of one vocab split; writes the split's partials.
// kStore: also writes each tile's raw logits (fp32, before the temperature) to a.logits as
// column pairs, for the training path.
template <bool kStore>
struct ForwardEpilogue {
  using Args = ForwardArgs;
  const Args& a;
  Fragment frag;
  int m0;
  Stats st[2];
  int label[2];  // label as a row of this shard, -1 when not among its valid rows

  __device__ __forceinline__ ForwardEpilogue(const Args& args, Fragment f, int m0_)
      : a(args), frag(f), m0(m0_) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      st[h] = empty_stats();
      const int row = m0 + frag.row(h);
      const int64_t l = row < a.T ? a.labels[row] - a.vocab_start : -1;
      label[h] = (l >= 0 && l < a.valid_v) ? static_cast<int>(l) : -1;
    }
  }

  __device__ __forceinline__ void tile(const float (&acc)[kAccRegs], int n0) {
    if constexpr (kStore) store(acc, n0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + frag.row(h);
      fold_row<kAccRegs / 2>(
          st[h], [&](int i) { return acc[Fragment::reg(h, i / 2, i % 2)]; },
          [&](int i) { return n0 + frag.col(i / 2, i % 2); }, a.valid_v, a.inv_tau, label[h],
          row < a.T ? a.label_logit + row : nullptr, n0, BN);
    }
  }

  __device__ __forceinline__ void store(const float (&acc)[kAccRegs], int n0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + frag.row(h);
      if (row >= a.T) continue;
      float* out = a.logits + static_cast<size_t>(row) * a.ld;
#pragma unroll
      for (int j = 0; j < kAccRegs / 4; ++j) {
        const int v = n0 + frag.col(j, 0);  // even: v and v + 1 form a pair
        const float x0 = acc[Fragment::reg(h, j, 0)], x1 = acc[Fragment::reg(h, j, 1)];
        if (v + 1 < a.valid_v) {
          *reinterpret_cast<float2*>(out + v) = make_float2(x0, x1);
        } else if (v < a.valid_v) {
          out[v] = x0;
        }
      }
    }
  }

  __device__ __forceinline__ void finish() {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const Stats s = quad_merge(st[h]);
      const int row = m0 + frag.row(h);
      if ((frag.lane & 3) != 0 || row >= a.T) continue;
      const size_t plane = static_cast<size_t>(gridDim.y) * a.T;
      const size_t at = static_cast<size_t>(grouped_col()) * a.T + row;
      a.part[at] = s.m;
      a.part[plane + at] = s.s;
      a.part[2 * plane + at] = s.u;
    }
  }
};


// Writes the softmax gradient of the tile's columns below col_end, as bf16 pairs.
struct BackwardEpilogue {
  using Args = BackwardArgs;
  const Args& a;
  Fragment frag;
  int m0;

  __device__ __forceinline__ BackwardEpilogue(const Args& args, Fragment f, int m0_)
      : a(args), frag(f), m0(m0_) {}

  __device__ __forceinline__ void tile(const float (&acc)[kAccRegs], int n0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + frag.row(h);
      if (row >= a.T) continue;
      const RowGrad r{a.lse[row], a.mean_z[row], a.g_lp[row], a.g_ent[row],
                      a.labels[row] - a.vocab_start, row_theta(a.theta, row)};
      __nv_bfloat16* out = a.dz + static_cast<size_t>(row) * a.ld - a.col_begin;
      with_truncation(a.theta, [&](auto truncated) {
        constexpr bool kTrunc = decltype(truncated)::value;
#pragma unroll
        for (int j = 0; j < kAccRegs / 4; ++j) {
          const int v = n0 + frag.col(j, 0);  // even: v and v + 1 form a bf16 pair
          if (v >= a.col_end) continue;
          const float g0 =
              softmax_grad<kTrunc>(acc[Fragment::reg(h, j, 0)], v, r, a.valid_v, a.inv_tau);
          const float g1 =
              softmax_grad<kTrunc>(acc[Fragment::reg(h, j, 1)], v + 1, r, a.valid_v, a.inv_tau);
          if (v + 1 < a.col_end) {
            *reinterpret_cast<__nv_bfloat162*>(out + v) = __floats2bfloat162_rn(g0, g1);
          } else {
            out[v] = __float2bfloat16_rn(g0);
          }
        }
      });
    }
  }

  __device__ __forceinline__ void finish() {}
};

#endif  // MEGARL_SM90A

// One CTA per (vocab split, token block), ordered by grouped_grid (cta_order.cuh); split x owns
// vocab tiles [x * tiles_per_split, ...).
template <bool kStore>
__global__ void __launch_bounds__(sm90::THREADS, 1)
    logprob_forward_sm90_kernel(const __grid_constant__ CUtensorMap tm_hidden,
                                const __grid_constant__ CUtensorMap tm_weight, ForwardArgs args,
                                int H, int tiles_per_split, int num_tiles) {
#ifdef MEGARL_SM90A
  const int m0 = grouped_row() * BM;
  if (m0 >= args.T) return;  // the last group's CTAs past the last token block
  const int first = grouped_col() * tiles_per_split;
  const int count = max(0, min(num_tiles, first + tiles_per_split) - first);
  sm90::mainloop<ForwardEpilogue<kStore>>(tm_hidden, tm_weight, m0, first * BN, count, H, args);
#else
  __trap();  // the host launches this only where the sm_90a code is present
#endif
}

// One CTA per (vocab tile of the column range, token block), ordered by grouped_grid.
__global__ void __launch_bounds__(sm90::THREADS, 1)
    logprob_backward_dz_sm90_kernel(const __grid_constant__ CUtensorMap tm_hidden,
                                    const __grid_constant__ CUtensorMap tm_weight,
                                    BackwardArgs args, int H) {
#ifdef MEGARL_SM90A
  const int m0 = grouped_row() * BM;
  if (m0 >= args.T) return;
  sm90::mainloop<BackwardEpilogue>(tm_hidden, tm_weight, m0, args.col_begin + grouped_col() * BN, 1, H, args);
#else
  __trap();
#endif
}

#ifndef MEGARL_HOST_EMULATION
// Reports whether this binary holds the sm_90a code for the running device.
__global__ void sm90a_probe_kernel(int* out) {
#ifdef MEGARL_SM90A
  *out = 1;
#else
  *out = 0;
#endif
}
#endif

#ifndef MEGARL_HOST_EMULATION
// A driver API function by name and the CUDA version of its signature, or null where the driver
// lacks it (the runtime links no driver symbols).
void* driver_function(const char* name, int version) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &found);
#else
  (void)version;
  const cudaError_t err = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &found);
#endif
  return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? p : nullptr;
}
#endif

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
#ifdef MEGARL_HOST_EMULATION
  return cuda_emu::tensor_map_encode_tiled;  // no driver on the host: maps the emulator reads
#else
  static const auto fn =
      reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(driver_function("cuTensorMapEncodeTiled", 12000));
  return fn;
#endif
}

// "CUDA_ERROR_INVALID_VALUE (1)": a driver result by its name (cuGetErrorName) and number.
std::string cu_result_name(CUresult r) {
  const char* name = nullptr;
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::get_error_name(r, &name);
#else
  static const auto get_name = reinterpret_cast<PFN_cuGetErrorName_v6000>(driver_function("cuGetErrorName", 6000));
  if (get_name != nullptr) get_name(r, &name);
#endif
  return std::string(name != nullptr ? name : "CUresult") + " (" + std::to_string(static_cast<int>(r)) + ")";
}

// The detail of this thread's last failed launch, which a cudaError_t cannot carry (bindings.cpp
// appends it to the exception): set where the driver refuses a tensor map.
thread_local std::string g_launch_error_detail;

// Tensor map of a row-major bf16 [rows, cols] matrix, read in [box_rows, BK] tiles with the
// 128-byte swizzle that the wgmma descriptors expect; reads past the edges give zeros. A refusal
// by the driver is cudaErrorInvalidValue, with its code and every parameter in the launch detail.
cudaError_t make_tensor_map(CUtensorMap* map, const char* name, const void* data, int rows, int cols,
                            int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {sm90::BK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  const CUresult r = encode_tiled()(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(data),
                                    dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                    CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r == CUDA_SUCCESS) return cudaSuccess;
  char params[320];
  std::snprintf(params, sizeof(params),
                "dtype bf16, rank 2, address %p, dims {%llu, %llu}, strides {%llu} bytes, box {%u, %u}, "
                "element strides {1, 1}, interleave none, swizzle 128B, L2 promotion 256B, oob fill none",
                data, static_cast<unsigned long long>(dims[0]), static_cast<unsigned long long>(dims[1]),
                static_cast<unsigned long long>(strides[0]), box[0], box[1]);
  g_launch_error_detail = "cuTensorMapEncodeTiled returned " + cu_result_name(r) + " for the " + name +
                          " tensor map [" + params + "]";
  return cudaErrorInvalidValue;
}

cudaError_t make_operand_maps(CUtensorMap* hidden_map, CUtensorMap* weight_map, const void* hidden,
                              const void* weight, int T, int H, int valid_v) {
  cudaError_t err = make_tensor_map(hidden_map, "hidden", hidden, T, H, BM);
  return err != cudaSuccess ? err : make_tensor_map(weight_map, "weight", weight, valid_v, H, BN);
}

cudaError_t set_smem(const void* kernel) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sm90::SMEM_BYTES);
}

}  // namespace

#ifndef MEGARL_HOST_EMULATION
namespace {

// Why the sm_90a kernels cannot run here for good, or "" when they can: the checks whose answer
// does not change while the process lives (device, driver entry point, the code in the binary).
// A failed probe launch is not among them: sm90_mainloop_status reports it and tries again.
std::string sm90_register_problem() {
  const void* kernels[] = {reinterpret_cast<const void*>(&logprob_forward_sm90_kernel<false>),
                           reinterpret_cast<const void*>(&logprob_forward_sm90_kernel<true>),
                           reinterpret_cast<const void*>(&logprob_backward_dz_sm90_kernel)};
  const char* names[] = {"logprob_forward_sm90_kernel", "logprob_forward_sm90_kernel (storing)",
                         "logprob_backward_dz_sm90_kernel"};
  for (int i = 0; i < 3; ++i) {
    cudaFuncAttributes attr{};
    const cudaError_t err = cudaFuncGetAttributes(&attr, kernels[i]);
    if (err != cudaSuccess)
      return std::string("cudaFuncGetAttributes(") + names[i] + ") failed: " + cudaGetErrorString(err);
    if (attr.numRegs != sm90::kEntryRegs)
      return std::string(names[i]) + " was compiled to " + std::to_string(attr.numRegs) +
             " registers per thread; its setmaxnreg split (" + std::to_string(sm90::kProducerRegs) +
             "/" + std::to_string(sm90::kConsumerRegs) + ") needs exactly " +
             std::to_string(sm90::kEntryRegs) + " at entry, or the consumers would hang";
  }
  return "";
}

}  // namespace
#endif

Sm90Status sm90_mainloop_status() {
#ifdef MEGARL_HOST_EMULATION
  return {true, true, ""};  // built for the emulator, whose sm_90a instructions check its device
#else
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return {false, false, std::string("cudaGetDevice failed: ") + cudaGetErrorString(err)};
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major != 9 || minor != 0)
    return {false, true, "the device is sm_" + std::to_string(major) + std::to_string(minor) + ", not sm_90"};
  if (encode_tiled() == nullptr)
    return {false, true, "the driver has no cuTensorMapEncodeTiled (TMA tensor maps need CUDA 12)"};
  constexpr int kMaxDevices = 64;
  static Sm90Status known[kMaxDevices];  // definite answers only
  if (device < kMaxDevices && known[device].definite) return known[device];
  int* flag = nullptr;
  int found = 0;
  err = cudaMalloc(&flag, sizeof(int));
  if (err == cudaSuccess) {
    sm90a_probe_kernel<<<1, 1>>>(flag);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpy(&found, flag, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(flag);
  }
  if (err != cudaSuccess)  // not cached: a transient failure must not turn the path off for good
    return {false, false, std::string("the sm_90a probe kernel failed: ") + cudaGetErrorString(err)};
  Sm90Status status{true, true, ""};
  if (found != 1) {
    status = {false, true, "this binary has no sm_90a code (build with -gencode=arch=compute_90a,code=sm_90a)"};
  } else if (std::string problem = sm90_register_problem(); !problem.empty()) {
    status = {false, true, problem};
  }
  if (device < kMaxDevices) known[device] = status;
  return status;
#endif
}

bool sm90_mainloop_available() { return sm90_mainloop_status().available; }

std::string take_launch_error_detail() { return std::exchange(g_launch_error_detail, std::string()); }

cudaError_t launch_logprob_forward_sm90(const void* hidden, const void* weight, const int64_t* labels,
                                        int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                                        int num_splits, float* part, float* label_logit,
                                        float* logits, int ld, int cta_group, cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  if (H % 8 != 0 || num_splits <= 0 || valid_v <= 0 || cta_group <= 0) return cudaErrorInvalidValue;
  if (logits != nullptr && (ld % 2 != 0 || ld < valid_v)) return cudaErrorInvalidValue;
  const auto kernel = logits != nullptr ? logprob_forward_sm90_kernel<true> : logprob_forward_sm90_kernel<false>;
  CUtensorMap tm_hidden, tm_weight;
  cudaError_t err = make_operand_maps(&tm_hidden, &tm_weight, hidden, weight, T, H, valid_v);
  if (err == cudaSuccess) err = set_smem(reinterpret_cast<const void*>(kernel));
  if (err != cudaSuccess) return err;
  const int num_tiles = (valid_v + BN - 1) / BN;
  const int tiles_per_split = (num_tiles + num_splits - 1) / num_splits;
  const ForwardArgs args{labels, T, valid_v, vocab_start, inv_tau, part, label_logit, logits, ld};
  const dim3 grid = grouped_grid(num_splits, (T + BM - 1) / BM, cta_group);
  MEGARL_LAUNCH(kernel, grid, sm90::THREADS, sm90::SMEM_BYTES, stream)(
      tm_hidden, tm_weight, args, H, tiles_per_split, num_tiles);
  return cudaGetLastError();
}

cudaError_t launch_logprob_backward_dz_sm90(const void* hidden, const void* weight,
                                            const int64_t* labels, int T, int H, int valid_v,
                                            int64_t vocab_start, float inv_tau, const float* lse,
                                            const float* mean_z, const float* g_lp, const float* g_ent,
                                            const float* theta, int col_begin, int col_count, void* dz,
                                            int ld, int cta_group, cudaStream_t stream) {
  if (T <= 0 || col_count <= 0) return cudaSuccess;
  if (H % 8 != 0 || col_begin % 2 != 0 || ld % 2 != 0 || ld < col_count || valid_v <= 0 || cta_group <= 0)
    return cudaErrorInvalidValue;
  CUtensorMap tm_hidden, tm_weight;
  cudaError_t err = make_operand_maps(&tm_hidden, &tm_weight, hidden, weight, T, H, valid_v);
  if (err == cudaSuccess) err = set_smem(reinterpret_cast<const void*>(&logprob_backward_dz_sm90_kernel));
  if (err != cudaSuccess) return err;
  const BackwardArgs args{labels, T, valid_v, vocab_start, inv_tau, lse, mean_z, g_lp, g_ent, theta,
                          col_begin, col_begin + col_count, static_cast<__nv_bfloat16*>(dz), ld};
  const dim3 grid = grouped_grid((col_count + BN - 1) / BN, (T + BM - 1) / BM, cta_group);
  MEGARL_LAUNCH(logprob_backward_dz_sm90_kernel, grid, sm90::THREADS, sm90::SMEM_BYTES, stream)(
      tm_hidden, tm_weight, args, H);
  return cudaGetLastError();
}

}  // namespace megarl
