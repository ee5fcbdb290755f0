// Host emulation of the CUDA features that the sm_80 kernels in csrc/ use, so that the real
// kernel sources compile with g++ (-DMEGARL_HOST_EMULATION, see csrc/host_emulation.h) and run
// on a CPU: tests/kernels/test_kernels_emulated.py checks them against the torch reference.
//
// Execution model. A launch runs its CTAs one after another. The threads of a CTA are fibers
// (ucontext) on one OS thread, which switch only where a thread has to wait for others: at
// __syncthreads and at the warp-collective instructions (ldmatrix, mma, shfl), which execute
// once all 32 lanes of the warp have arrived. The schedule is deterministic: the lowest-numbered
// thread that can proceed runs, so warps drift apart as far as barriers let them. A run aborts,
// with a message on stderr, on anything the hardware would not do as the kernel expects: a barrier
// that some thread never reaches, lanes of one warp at different collectives, a misaligned or
// out-of-range shared-memory access, a cp.async source outside the registered global buffers.
// Shared memory starts as NaN bytes, and cp.async lands at the latest moment the PTX ISA allows
// (or, with CUDA_EMU_CP_ASYNC=issue, the earliest), so that missing waits and barriers show.
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

#include <cuda_bf16.h>  // host implementations of the bf16 types and conversions
#include <cuda_runtime_api.h>

// host_defines.h (included above) defines __global__, __device__, __forceinline__ and __align__
// for a host compiler, and __shared__ as nothing. A __shared__ variable is one per CTA: CTAs run
// one at a time, so a function-local static is exactly that.
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)

// Built-in variables; the scheduler sets threadIdx at every switch to a thread.
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace cuda_emu {

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

// Declares [p, p + bytes) device memory: cp.async sources must lie in such a buffer.
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

inline int __float_as_int(float x) {
  int i;
  std::memcpy(&i, &x, 4);
  return i;
}

inline int min(int a, int b) { return a < b ? a : b; }

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
