// Host emulation of the CUDA features that the kernels in csrc/ use, so that the real kernel
// sources compile with g++ (-DMEGARL_HOST_EMULATION, see csrc/host_emulation.h) and run on a CPU:
// tests/kernels/test_kernels_emulated.py checks them against the torch reference. It covers the
// sm_80 kernels (cp.async, ldmatrix, mma.sync, shuffles) and the sm_90a ones (mbarrier, TMA tensor
// copies, wgmma with shared-memory descriptors, setmaxnreg).
//
// Execution model. A launch runs its CTAs one after another. The threads of a CTA are fibers
// (ucontext) on one OS thread, which switch only where a thread has to wait for others: at
// __syncthreads, at the warp- and warpgroup-collective instructions (ldmatrix, mma, shfl, wgmma,
// setmaxnreg), which execute once all their threads have arrived, and at an mbarrier wait whose
// phase has not completed. The schedule is deterministic: the lowest-numbered thread that can
// proceed runs, so warps drift apart as far as barriers let them. A run aborts, with a message on
// stderr, on anything the hardware would not do as the kernel expects: a barrier that some thread
// never reaches (a deadlock, mbarrier waits included), lanes of one warp at different
// collectives, a misaligned or out-of-range shared-memory access, a copy source outside the
// registered global buffers, a malformed tensor map or wgmma descriptor.
//
// Asynchronous operations. Shared memory starts as NaN bytes, and every asynchronous operation
// takes effect at one end of the window the PTX ISA allows, chosen by CUDA_EMU_ASYNC so that a
// synchronisation bug shows as wrong data:
//   late (default): copies into shared memory land at the latest moment (a cp.async at the
//     cp.async.wait_group that covers it, a TMA tensor copy only once no thread can proceed
//     without it) and a wgmma reads its shared-memory operands at issue, the earliest: a read
//     that comes before its data has landed (a missing or wrong wait) sees stale data;
//   early: copies land at issue and a wgmma reads its operands at the wgmma.wait_group that
//     covers it, the latest: a stage refilled while a read of it is still in flight (released
//     too early) corrupts that read.
// wgmma results reach the registers only at that wait_group in both modes. A correct kernel
// gives the same results in both.
//
// The PTX instructions are written from the PTX ISA (the sections are named in
// cuda_host_emu.cpp), not from the kernels' use of them, so that the test checks the kernels'
// index arithmetic against an independent statement of the hardware semantics.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

#include <cuda.h>       // CUtensorMap and the types of cuTensorMapEncodeTiled
#include <cuda_bf16.h>  // host implementations of the bf16 types and conversions
#include <cuda_runtime_api.h>

// host_defines.h (included above) defines __global__, __device__, __forceinline__ and __align__
// for a host compiler, and __shared__ as nothing. A __shared__ variable is one per CTA: CTAs run
// one at a time, so a function-local static is exactly that.
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)
// A __grid_constant__ kernel parameter (a CUtensorMap) is an ordinary by-value parameter here:
// each fiber calls the kernel with its own copy, which TMA instructions read through a pointer.
#undef __grid_constant__
#define __grid_constant__

// Built-in variables; the scheduler sets threadIdx at every switch to a thread.
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace cuda_emu {

// The emulated device's compute capability: 8.0 unless set otherwise. The sm_90a instructions
// abort on any other than 9.0, and the opt-in dynamic shared memory limit follows it (163 KB on
// 8.0, 227 KB on 9.0).
void set_compute_capability(int major, int minor);

// Runs kernel_body in every thread of every CTA of the grid; returns when all have exited.
// `kernel` identifies the kernel for its cudaFuncSetAttribute limits.
void run_grid(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem_bytes,
              const std::function<void()>& kernel_body);

// kernel<<<grid, block, smem, stream>>>(args...), as cuda_emu::launch(kernel, grid, block, smem,
// stream)(args...): the arguments convert to the kernel's parameter types as in a CUDA launch.
template <class... Params>
class Launch {
 public:
  Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem)
      : kernel_(kernel), grid_(grid), block_(block), smem_(smem) {}

  template <class... Args>
  void operator()(Args&&... args) const {
    run_grid(reinterpret_cast<const void*>(kernel_), grid_, block_, smem_,
             [&] { kernel_(args...); });
  }

 private:
  void (*kernel_)(Params...);
  dim3 grid_, block_;
  size_t smem_;
};

template <class... Params>
Launch<Params...> launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t /*stream: launches run synchronously*/) {
  return Launch<Params...>(kernel, grid, block, smem);
}

// The running CTA's dynamic shared memory (extern __shared__ unsigned char name[]).
unsigned char* dynamic_smem();

// Declares [p, p + bytes) device memory: cp.async and TMA sources must lie in such a buffer.
void register_global(const void* p, size_t bytes);

void syncthreads();
size_t cvta_generic_to_shared(const void* p);
uint32_t shfl_xor_sync(uint32_t member_mask, uint32_t value, int lane_mask, int width);

// PTX instructions, named after their full opcode; operands as in the inline asm.
void cp_async_cg_shared_global_16(uint32_t dst, const void* src, int src_size);
void cp_async_commit_group();
void cp_async_wait_group(int n);
void ldmatrix_sync_aligned_m8n8_x4_shared_b16(uint32_t (&r)[4], uint32_t addr);
void mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(float (&d)[4], const uint32_t (&a)[4],
                                                          const uint32_t (&b)[2],
                                                          const float (&c)[4]);

// sm_90a. mbarrier.try_wait suspends the thread until the phase completes, so it only returns
// true (a wait that can never complete is reported as a deadlock), unless CUDA_EMU_TRY_WAIT=
// time-limit: then such a wait returns false, as the hardware's does after its time limit, and
// advances globaltimer() by that limit (cuda_host_emu.cpp: kTryWaitLimitNs).
void mbarrier_init_shared_cta_b64(uint32_t addr, uint32_t count);
void mbarrier_arrive_shared_cta_b64(uint32_t addr);
void mbarrier_arrive_expect_tx_shared_cta_b64(uint32_t addr, uint32_t tx_count);
bool mbarrier_try_wait_parity_shared_cta_b64(uint32_t addr, uint32_t parity);
// mov.u64 %r, %globaltimer (ns); it starts at CUDA_EMU_GLOBALTIMER_START (default 0), so that a
// test can put the 32-bit wrap of a kernel's tick count inside a wait
uint64_t globaltimer();
void fence_mbarrier_init_release_cluster();
// cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
//   [dst], [tensor_map, {c0, c1}], [mbar]   (c0 the innermost coordinate)
void cp_async_bulk_tensor_2d_shared_cluster_global_tile_mbarrier_complete_tx_bytes(uint32_t dst,
                                                                          const CUtensorMap* tensor_map,
                                                                          int c0, int c1,
                                                                          uint32_t mbar);
void wgmma_fence_sync_aligned();
void wgmma_commit_group_sync_aligned();
void wgmma_wait_group_sync_aligned(int n);
// wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 d, a-desc, b-desc, scale-d,
//   imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b. d is read (scale-d != 0) and written when
// the operation completes, at the wgmma.wait_group that covers it.
void wgmma_mma_async_sync_aligned_m64n256k16_f32_bf16_bf16(float (&d)[128], uint64_t desc_a,
                                                           uint64_t desc_b, int scale_d,
                                                           int imm_scale_a, int imm_scale_b,
                                                           int imm_trans_a, int imm_trans_b);
void setmaxnreg_inc_sync_aligned_u32(uint32_t count);
void setmaxnreg_dec_sync_aligned_u32(uint32_t count);
[[noreturn]] void trap();

// cuTensorMapEncodeTiled (CUDA driver API), which needs a driver: the same contract, with the
// map's fields kept in the CUtensorMap's opaque bytes in a layout of the emulator's own, which
// only the emulated TMA instructions read.
CUresult tensor_map_encode_tiled(CUtensorMap* tensor_map, CUtensorMapDataType data_type,
                                 cuuint32_t rank, void* global_address, const cuuint64_t* global_dim,
                                 const cuuint64_t* global_strides, const cuuint32_t* box_dim,
                                 const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                 CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
                                 CUtensorMapFloatOOBfill oob_fill);

// cuGetErrorName (CUDA driver API) for the results tensor_map_encode_tiled returns.
CUresult get_error_name(CUresult error, const char** name);

}  // namespace cuda_emu

// CUDA device functions. The atomics need no locking: all threads run on one OS thread, and a
// thread is only ever switched out inside __syncthreads or a warp collective.
inline void __syncthreads() { cuda_emu::syncthreads(); }

inline size_t __cvta_generic_to_shared(const void* p) {
  return cuda_emu::cvta_generic_to_shared(p);
}

template <class T>
T __shfl_xor_sync(unsigned member_mask, T var, int lane_mask, int width = 32) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  uint32_t bits;
  std::memcpy(&bits, &var, 4);
  bits = cuda_emu::shfl_xor_sync(member_mask, bits, lane_mask, width);
  std::memcpy(&var, &bits, 4);
  return var;
}

inline float __expf(float x) { return expf(x); }

[[noreturn]] inline void __trap() {
  cuda_emu::trap();
  __builtin_unreachable();
}

inline int __float_as_int(float x) {
  int i;
  std::memcpy(&i, &x, 4);
  return i;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}

inline int atomicMax(int* p, int v) {
  const int old = *p;
  *p = old > v ? old : v;
  return old;
}

inline int atomicMin(int* p, int v) {
  const int old = *p;
  *p = old < v ? old : v;
  return old;
}
