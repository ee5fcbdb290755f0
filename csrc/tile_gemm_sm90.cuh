// The sm_90a (Hopper) mainloop of the fused logprob kernels: a warp-specialised CTA whose
// producer warp streams [128 x 64] hidden and [256 x 64] LM-head tiles into shared memory
// with TMA (cp.async.bulk.tensor, 128-byte swizzle), and whose two consumer warpgroups each
// multiply 64 token rows by the 256 vocab rows with wgmma (m64n256k16, bf16 in, fp32 in
// registers). STAGES buffers circulate between them on mbarriers: `full` completes when a
// stage's bytes have landed, `empty` when every consumer warp has finished reading it.
//
// The logit tile then lives only in the consumers' registers, where an epilogue (forward:
// online logsumexp; backward: softmax gradient) consumes it; see fused_logprob_sm90.cu.
//
// Everything here needs sm_90a; the code compiles to nothing for other targets and the host
// only launches it after sm90_mainloop_available() said the sm_90a code is in the binary.
// Under the host emulator of tests/kernels/emulator (-DMEGARL_HOST_EMULATION) the same code
// compiles with g++, each PTX instruction a call into the emulator; under nvcc the
// MEGARL_HOST_EMULATION branches are not compiled, so the device code is unchanged.
#pragma once

#include <cstdint>
#include <cstdio>  // printf of a wait time-out (MEGARL_MBAR_TIMEOUT_PRINTF)

#include <cuda.h>  // CUtensorMap

#include "host_emulation.h"
#include "kernels.h"

#if (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)) || defined(MEGARL_HOST_EMULATION)
#define MEGARL_SM90A 1
#endif

namespace megarl {
namespace sm90 {

constexpr int BM = kTileTokens;  // token rows per CTA: one 64-row slab per consumer warpgroup
constexpr int BN = kTileVocabSm90;  // vocab rows per tile: the N of one wgmma (256)
constexpr int BK = 64;        // 64 bf16 = 128 bytes: one row of the 128-byte swizzle pattern
constexpr int STAGES = 4;
constexpr int CONSUMERS = 2;  // consumer warpgroups; warpgroup 0 is the producer
constexpr int THREADS = 128 * (1 + CONSUMERS);
constexpr int kAccRegs = 64 * BN / 128;  // fp32 accumulators per consumer thread
// setmaxnreg moves registers from the producer warpgroup to the consumers, within what the CTA
// was given at launch: __launch_bounds__(THREADS, 1) lets ptxas allocate 65536 / 384 = 170
// registers per thread, 168 in its units of 8, and the split needs exactly that many at entry.
// With fewer, the consumers' setmaxnreg.inc would wait for registers the CTA does not hold: the
// host checks the kernels' count (sm90_mainloop_status) and tests/kernels checks ptxas's.
constexpr int kEntryRegs = 168;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = BN * BK * 2;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SWIZZLE_ATOM = 1024;  // 8 rows x 128 bytes: stage buffers start on this boundary
// stage buffers, then the full and empty barriers; the slack aligns the dynamic smem base
constexpr int SMEM_BYTES = SWIZZLE_ATOM + STAGES * STAGE_BYTES + 2 * STAGES * 8;

static_assert(BM == 64 * CONSUMERS, "each consumer warpgroup owns 64 token rows");
static_assert(A_BYTES % SWIZZLE_ATOM == 0 && B_BYTES % SWIZZLE_ATOM == 0, "stages stay atom-aligned");
static_assert(128 * kProducerRegs + 128 * CONSUMERS * kConsumerRegs <= THREADS * kEntryRegs,
              "the register split fits in what the CTA holds at entry");

// Where a consumer thread's accumulators sit in the [BM, BN] tile. wgmma's D fragment: warp w
// of the warpgroup owns rows 16w..16w+15; per 8-column chunk j, acc[4j + 2h + e] is at row
// lane/4 + 8h, column 8j + 2 (lane % 4) + e.
struct Fragment {
  int consumer;  // 0..CONSUMERS-1
  int warp;      // warp within the warpgroup, 0..3
  int lane;

  __device__ __forceinline__ int row(int half) const {
    return 64 * consumer + 16 * warp + (lane >> 2) + 8 * half;
  }
  __device__ __forceinline__ int col(int chunk, int e) const { return 8 * chunk + 2 * (lane & 3) + e; }
  // the index in acc of (half, chunk, e)
  static __device__ __forceinline__ int reg(int half, int chunk, int e) { return 4 * chunk + 2 * half + e; }
};

#ifdef MEGARL_SM90A

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::mbarrier_init_shared_cta_b64(smem_addr(bar), count);
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
#endif
}

// Makes the initialised barriers visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void fence_mbar_init() {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::fence_mbarrier_init_release_cluster();
#else
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::mbarrier_arrive_shared_cta_b64(smem_addr(bar));
#else
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// Arrive, and tell the barrier to also wait for `bytes` of TMA transactions.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::mbarrier_arrive_expect_tx_shared_cta_b64(smem_addr(bar), bytes);
#else
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// How long a thread waits for an mbarrier phase before it traps, in ns: MEGARL_MBAR_TIMEOUT_NS,
// 4 s unless the build defines it (e.g. MEGARL_NVCC_FLAGS="-DMEGARL_MBAR_TIMEOUT_NS=600000000000"
// under cuda-gdb or compute-sanitizer, which slow a kernel down far beyond 4 s), where a working
// pipeline waits microseconds. A barrier bug (a wrong phase, a missing arrive, expect-tx bytes that
// never land) then fails the launch instead of hanging the GPU: the next synchronisation reports
// cudaErrorIllegalInstruction ("an illegal instruction was encountered"), the only trap these
// kernels reach. Built with MEGARL_MBAR_TIMEOUT_PRINTF (and in the host emulator) the trapping
// thread first prints its block, thread and awaited parity; not by default, because printf is a
// function call, and a call in a wgmma kernel makes ptxas serialise the wgmmas and ignore
// setmaxnreg (C7510, C7507).
#ifndef MEGARL_MBAR_TIMEOUT_NS
#define MEGARL_MBAR_TIMEOUT_NS 4000000000ull
#endif
// The wait counts ticks of 2^10 ns (the 64-bit %globaltimer shifted) in 32 bits: one register to
// hold across the wait, where the accumulators leave the consumers none to spare (clock64 made
// the forward spill), and a signed difference of two readings, which stays right
// across the 32-bit wrap and when the timer is set back, for bounds up to 2^31 ticks (36 min).
constexpr int kTimerTickShift = 10;
constexpr unsigned long long kMbarTimeoutNs = MEGARL_MBAR_TIMEOUT_NS;
static_assert(kMbarTimeoutNs >> kTimerTickShift >= 1 && kMbarTimeoutNs >> kTimerTickShift < (1ull << 31),
              "MEGARL_MBAR_TIMEOUT_NS must lie in [1024 ns, 2^41 ns (about 36 minutes))");
constexpr int32_t kMbarTimeoutTicks = static_cast<int32_t>(kMbarTimeoutNs >> kTimerTickShift);

// Whether the phase with this parity has completed (a fresh barrier counts parity 1 as done).
// try_wait may suspend the thread for a system-dependent time limit before it answers false.
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
#ifdef MEGARL_HOST_EMULATION
  return cuda_emu::mbarrier_try_wait_parity_shared_cta_b64(smem_addr(bar), parity);
#else
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.b32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
#endif
}

#if defined(MEGARL_MBAR_TIMEOUT_PRINTF) || defined(MEGARL_HOST_EMULATION)
#define MEGARL_MBAR_REPORT(bar, parity, waited_ticks)                                            \
  printf("megarl: mbarrier wait timed out after %llu ns: block (%d,%d,%d) thread %d waits "      \
         "for parity %u of the mbarrier at shared address %u\n",                                 \
         static_cast<unsigned long long>(waited_ticks) << kTimerTickShift,                      \
         static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),                             \
         static_cast<int>(blockIdx.z), static_cast<int>(threadIdx.x),                            \
         static_cast<unsigned>(parity), smem_addr(bar))
#else
#define MEGARL_MBAR_REPORT(bar, parity, waited_ticks) static_cast<void>(0)
#endif

// The global nanosecond timer in ticks of 2^10 ns, truncated to 32 bits (see kTimerTickShift).
__device__ __forceinline__ uint32_t globaltimer_ticks() {
#ifdef MEGARL_HOST_EMULATION
  return static_cast<uint32_t>(cuda_emu::globaltimer() >> kTimerTickShift);
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return static_cast<uint32_t>(t >> kTimerTickShift);
#endif
}

// Wait until the phase with this parity has completed; trap after kMbarTimeoutNs.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const uint32_t start = globaltimer_ticks();
  while (!mbar_try_wait(bar, parity)) {
    // signed: a wrap of the 32-bit count gives the true elapsed ticks, a timer set back a
    // negative count (no false time-out)
    const int32_t waited = static_cast<int32_t>(globaltimer_ticks() - start);
    if (waited > kMbarTimeoutTicks) {
      MEGARL_MBAR_REPORT(bar, parity, waited);
#ifdef MEGARL_HOST_EMULATION
      __trap();
#else
      // trap as inline asm, followed by a loop exit that is never taken: __trap() is noreturn,
      // and that dead end made ptxas spill 228 bytes in the forward kernel's consumers
      asm volatile("trap;\n" ::: "memory");
      break;
#endif
    }
  }
}

// TMA: the [box rows x BK] tile at (row, k) of a 2-D tensor map into shared memory; rows and
// columns out of the tensor are zero-filled and still count towards the transaction bytes.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int k, int row,
                                         uint64_t* bar) {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::cp_async_bulk_tensor_2d_shared_cluster_global_tile_mbarrier_complete_tx_bytes(
      smem_addr(dst), map, k, row, smem_addr(bar));
#else
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(k), "r"(row)
      : "memory");
#endif
}

// wgmma shared-memory descriptor of a K-major operand in the 128-byte swizzle layout that TMA
// writes: start address, leading byte offset 16 (unused by this layout), stride byte offset
// 1024 (from one 8-row group to the next), swizzle mode 1 (128 B), all in 16-byte units.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  return ((smem_addr(p) & 0x3FFFFu) >> 4) | (uint64_t{16 >> 4} << 16) |
         (uint64_t{SWIZZLE_ATOM >> 4} << 32) | (uint64_t{1} << 62);
}

#ifdef MEGARL_HOST_EMULATION
__device__ __forceinline__ void wgmma_fence() { cuda_emu::wgmma_fence_sync_aligned(); }
__device__ __forceinline__ void wgmma_commit() { cuda_emu::wgmma_commit_group_sync_aligned(); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  cuda_emu::wgmma_wait_group_sync_aligned(N);
}
__device__ __forceinline__ void fence_operands(float (&)[kAccRegs]) {}
#else
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keep the compiler from moving accumulator reads or writes across the asynchronous wgmma.
__device__ __forceinline__ void fence_operands(float (&d)[kAccRegs]) {
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
#endif

// Hands registers from the producer warpgroup (dec) to the consumers (inc); whole warpgroups.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::setmaxnreg_dec_sync_aligned_u32(N);
#else
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::setmaxnreg_inc_sync_aligned_u32(N);
#else
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// d[0:128] (+)= A[64,16] . B[256,16]^T, both K-major in 128B-swizzled shared memory.
// accumulate = 0 overwrites d (the first K step of a tile).
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[kAccRegs], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#ifdef MEGARL_HOST_EMULATION
  cuda_emu::wgmma_mma_async_sync_aligned_m64n256k16_f32_bf16_bf16(d, desc_a, desc_b, accumulate, 1, 1,
                                                                  0, 0);
#else
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}

// One CTA: rows [m0, m0 + BM) of hidden against `num_tiles` vocab tiles of BN rows starting at
// shard row n_first. The consumers hand each finished tile to the epilogue (`tile(acc, n0)`),
// then call `finish()`. tm_a maps hidden [T, K], tm_b the LM-head shard [V, K] (K contiguous).
template <class Epilogue>
__device__ __forceinline__ void mainloop(const CUtensorMap& tm_a, const CUtensorMap& tm_b, int m0,
                                         int n_first, int num_tiles, int K,
                                         const typename Epilogue::Args& args) {
  MEGARL_DYNAMIC_SMEM(smem_raw);
  unsigned char* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + SWIZZLE_ATOM - 1) & ~uintptr_t{SWIZZLE_ATOM - 1});
  uint64_t* full = reinterpret_cast<uint64_t*>(base + STAGES * STAGE_BYTES);
  uint64_t* empty = full + STAGES;
  auto a_tile = [&](int s) { return base + s * STAGE_BYTES; };
  auto b_tile = [&](int s) { return base + s * STAGE_BYTES + A_BYTES; };

  const int warpgroup = threadIdx.x / 128;
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);                // the producer's arrive_expect_tx
      mbar_init(&empty[s], 4 * CONSUMERS);  // one arrive per consumer warp
    }
    fence_mbar_init();
  }
  __syncthreads();

  const int num_k = (K + BK - 1) / BK;
  if (warpgroup == 0) {  // producer
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    for (int t = 0; t < num_tiles; ++t) {
      for (int kb = 0; kb < num_k; ++kb) {
        mbar_wait(&empty[stage], phase ^ 1);
        mbar_arrive_expect_tx(&full[stage], STAGE_BYTES);
        tma_load(a_tile(stage), &tm_a, kb * BK, m0, &full[stage]);
        tma_load(b_tile(stage), &tm_b, kb * BK, n_first + t * BN, &full[stage]);
        if (++stage == STAGES) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const Fragment frag{warpgroup - 1, static_cast<int>(threadIdx.x / 32) % 4, lane};
  Epilogue epilogue(args, frag, m0);
  const int a_offset = frag.consumer * 64 * BK * 2;  // this warpgroup's 64-row slab
  float acc[kAccRegs] = {};  // overwritten by each tile's first wgmma (accumulate = 0)
  int stage = 0;
  uint32_t phase = 0;
  for (int t = 0; t < num_tiles; ++t) {
    int prev = -1;
    for (int kb = 0; kb < num_k; ++kb) {
      mbar_wait(&full[stage], phase);
      fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < BK / 16; ++k) {  // 16 bf16 = 32 bytes further along the swizzled rows
        wgmma_m64n256k16(acc, smem_desc(a_tile(stage) + a_offset + 32 * k),
                         smem_desc(b_tile(stage) + 32 * k), kb > 0 || k > 0);
      }
      wgmma_commit();
      wgmma_wait<1>();  // the previous K step is done: its stage may be refilled
      fence_operands(acc);
      if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
      prev = stage;
      if (++stage == STAGES) stage = 0, phase ^= 1;
    }
    wgmma_wait<0>();
    fence_operands(acc);
    if (lane == 0) mbar_arrive(&empty[prev]);
    epilogue.tile(acc, n_first + t * BN);
  }
  epilogue.finish();
}

#endif  // MEGARL_SM90A

}  // namespace sm90
}  // namespace megarl
