// The two pieces of CUDA syntax a host compiler cannot parse, as macros, so that the kernel
// sources also compile for the host emulator of tests/kernels/emulator (g++ with
// -DMEGARL_HOST_EMULATION; tests/kernels/test_kernels_emulated.py). Under nvcc they expand to
// the plain CUDA syntax, so the device code is unchanged.
#pragma once

#ifdef MEGARL_HOST_EMULATION

#include "cuda_host_emu.h"

#define MEGARL_DYNAMIC_SMEM(name) unsigned char* name = cuda_emu::dynamic_smem()
#define MEGARL_LAUNCH(kernel, grid, block, smem, stream) \
  cuda_emu::launch(kernel, grid, block, smem, stream)

#else

// extern __shared__ unsigned char name[]: the CTA's dynamic shared memory.
#define MEGARL_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
// MEGARL_LAUNCH(kernel, grid, block, smem, stream)(args...) is kernel<<<...>>>(args...).
#define MEGARL_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>

#endif
