// Scheduler, memory checks and PTX instruction semantics of the host emulation (cuda_host_emu.h).
#include "cuda_host_emu.h"

#include <ucontext.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <utility>
#include <vector>

namespace cuda_emu {
namespace {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = 128 << 10;
constexpr unsigned kMaxThreadsPerCta = 1024;
constexpr size_t kSmemAlign = 128;
// Dynamic shared memory per CTA: 48 KB by default, up to the sm_80 opt-in maximum (163 KB)
// after cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize).
constexpr int kDefaultDynamicSmem = 48 << 10;
constexpr int kMaxDynamicSmemOptIn = 163 << 10;

[[noreturn]] void fail(const char* fmt, ...) {
  std::va_list args;
  va_start(args, fmt);
  std::fputs("cuda_emu: ", stderr);
  std::vfprintf(stderr, fmt, args);
  std::fputc('\n', stderr);
  va_end(args);
  std::abort();
}

struct AsyncCopy {
  uint32_t dst;  // shared address
  const unsigned char* src;
  int src_size;
};

// A phase barrier of `count` threads: the last arrival runs the completion step, then releases.
struct Barrier {
  int count = 0;
  int arrived = 0;
  uint64_t phase = 0;
};

struct Thread {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  uint3 idx;
  int linear;  // x + y * blockDim.x + z * blockDim.x * blockDim.y
  bool exited;
  const Barrier* blocked_on;  // waits for this barrier to leave phase `blocked_phase`
  uint64_t blocked_phase;
  const char* blocked_at;     // the barrier's name, for a deadlock report
  std::vector<AsyncCopy> uncommitted;         // cp.async since the last commit_group
  std::deque<std::vector<AsyncCopy>> groups;  // committed and not yet complete, oldest first

  bool runnable() const {
    return !exited && (blocked_on == nullptr || blocked_on->phase != blocked_phase);
  }
};

// One lane's operands and results of a warp-collective instruction, as 32-bit registers.
struct LaneSlot {
  const char* op;
  uint32_t in[10];  // mma: a[4], b[2], c[4]; ldmatrix: the row address; shfl: value, lane mask
  uint32_t out[4];
};

struct Warp {
  Barrier barrier;
  LaneSlot lanes[kWarpSize];
};

struct Cta {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  Barrier barrier;  // __syncthreads
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  ucontext_t scheduler;
  int current = -1;
  const std::function<void()>* body = nullptr;
};

Cta* g_cta = nullptr;  // the CTA being run
std::map<const void*, int> g_max_dynamic_smem;
std::vector<std::pair<const unsigned char*, size_t>> g_global;

Cta& cta() {
  if (g_cta == nullptr) fail("device code called outside a kernel launch");
  return *g_cta;
}

Thread& self() { return cta().threads[cta().current]; }

void arrive_and_wait(Barrier& b, const char* what, const std::function<void()>& complete) {
  if (++b.arrived == b.count) {
    complete();
    b.arrived = 0;
    ++b.phase;
    return;
  }
  Thread& t = self();
  t.blocked_on = &b;
  t.blocked_phase = b.phase;
  t.blocked_at = what;
  swapcontext(&t.context, &cta().scheduler);  // resumed once the barrier has moved on
  t.blocked_on = nullptr;
}

// ---- memory -------------------------------------------------------------------------------

void check_shared(uint32_t addr, size_t bytes, size_t align, const char* what) {
  if (addr % align != 0) fail("%s: shared address %u is not %zu-byte aligned", what, addr, align);
  if (addr + bytes > cta().smem_bytes)
    fail("%s: shared bytes [%u, %zu) outside the %zu bytes of dynamic shared memory", what, addr,
         addr + bytes, cta().smem_bytes);
}

void check_global(const unsigned char* p, size_t bytes, const char* what) {
  for (const auto& [base, size] : g_global)
    if (p >= base && p + bytes <= base + size) return;
  fail("%s: global bytes [%p, %p) are not inside one registered buffer", what,
       static_cast<const void*>(p), static_cast<const void*>(p + bytes));
}

// ---- scheduler ----------------------------------------------------------------------------

void thread_main() {
  (*cta().body)();
  self().exited = true;
}  // returns to the scheduler (uc_link)

[[noreturn]] void report_deadlock(const Cta& c) {
  for (const Thread& t : c.threads)
    if (!t.exited)
      std::fprintf(stderr, "  thread (%u,%u,%u) waits at %s\n", t.idx.x, t.idx.y, t.idx.z,
                   t.blocked_at);
  fail("deadlock in CTA (%u,%u,%u): no thread can proceed (some exited or wait elsewhere)",
       blockIdx.x, blockIdx.y, blockIdx.z);
}

void start_cta(Cta& c) {
  // Shared memory starts as garbage on the hardware: all-ones bytes read as NaN (bf16 and fp32).
  std::memset(c.smem, 0xff, c.smem_bytes);
  c.barrier = Barrier{static_cast<int>(c.threads.size())};
  for (Warp& w : c.warps) w.barrier = Barrier{kWarpSize};
  for (Thread& t : c.threads) {
    t.exited = false;
    t.blocked_on = nullptr;
    t.uncommitted.clear();
    t.groups.clear();  // copies never waited for cannot be observed
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = t.stack.get();
    t.context.uc_stack.ss_size = kStackBytes;
    t.context.uc_link = &c.scheduler;
    makecontext(&t.context, thread_main, 0);
  }
}

// Always resumes the lowest-numbered thread that can proceed, so that warp 0 runs through a
// whole barrier interval before warp 1 starts it: the most skewed schedule the hardware allows,
// where a missing barrier shows as a warp reading data another warp has not written yet or has
// already overwritten.
void run_cta(Cta& c) {
  start_cta(c);
  for (;;) {
    size_t i = 0;
    while (i < c.threads.size() && !c.threads[i].runnable()) ++i;
    if (i == c.threads.size()) break;
    c.current = static_cast<int>(i);
    threadIdx = c.threads[i].idx;
    swapcontext(&c.scheduler, &c.threads[i].context);
  }
  for (const Thread& t : c.threads)
    if (!t.exited) report_deadlock(c);
  c.current = -1;
}

void check_launch(const void* kernel, dim3 grid, dim3 block, size_t smem) {
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerCta || block.z > 64)
    fail("invalid block (%u,%u,%u)", block.x, block.y, block.z);
  if (threads % kWarpSize != 0)
    fail("the emulator runs whole warps only; the block has %u threads", threads);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535)
    fail("invalid grid (%u,%u,%u)", grid.x, grid.y, grid.z);
  const auto it = g_max_dynamic_smem.find(kernel);
  const size_t limit = it == g_max_dynamic_smem.end() ? kDefaultDynamicSmem : it->second;
  if (smem > limit)
    fail("launch asks for %zu bytes of dynamic shared memory; the kernel's limit is %zu", smem,
         limit);
}

// ---- warp collectives -------------------------------------------------------------------

int lane_of(const Thread& t) { return t.linear % kWarpSize; }

// Executes a warp-collective instruction (.sync.aligned: all 32 lanes execute the same one):
// each lane deposits its operands, and when all lanes have arrived, `execute` computes the
// results of every lane. Returns this lane's slot, whose `out` holds its results.
LaneSlot& warp_collective(const char* op, const uint32_t* in, int n_in, void (*execute)(Warp&)) {
  Thread& t = self();
  Warp& w = cta().warps[t.linear / kWarpSize];
  LaneSlot& slot = w.lanes[lane_of(t)];
  slot.op = op;
  std::memcpy(slot.in, in, n_in * sizeof(uint32_t));
  arrive_and_wait(w.barrier, op, [&w, op, execute] {
    for (const LaneSlot& s : w.lanes)
      if (std::strcmp(s.op, op) != 0)
        fail("lanes of one warp at different collectives: %s and %s", op, s.op);
    execute(w);
  });
  return slot;
}

// shfl.sync.bfly.b32 with a full member mask (PTX ISA, "Data Movement and Conversion
// Instructions: shfl.sync"): lane l reads the value of lane l ^ lane_mask.
void execute_shfl_xor(Warp& w) {
  for (int l = 0; l < kWarpSize; ++l) w.lanes[l].out[0] = w.lanes[l ^ w.lanes[l].in[1]].in[0];
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (PTX ISA, "Warp-level matrix load instruction:
// ldmatrix"): four 8x8 matrices of 16-bit elements. Lanes 8j .. 8j+7 hold the addresses of rows
// 0..7 of matrix j; a row is 8 contiguous elements (16 bytes, 16-byte aligned). Lane l receives
// in register j the elements (row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1) of matrix j, the
// lower column in the lower half.
void execute_ldmatrix_x4(Warp& w) {
  const unsigned char* smem = cta().smem;
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < 8; ++r)
      check_shared(w.lanes[8 * j + r].in[0], 16, 16, "ldmatrix row");
  for (int l = 0; l < kWarpSize; ++l)
    for (int j = 0; j < 4; ++j) {
      const uint32_t row = w.lanes[8 * j + l / 4].in[0];
      std::memcpy(&w.lanes[l].out[j], smem + row + 4 * (l % 4), 4);
    }
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D = A B + C, A 16x16, B 16x8, C and D
// 16x8 fp32. Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
// type"), with groupID = lane >> 2 and threadID_in_group = lane % 4:
//   A: elements a0..a7, two per register in order, the lower index in the lower half;
//      row = groupID for a0, a1, a4, a5, groupID + 8 otherwise;
//      col = 2 threadID_in_group + (i & 1), + 8 for i >= 4.
//   B: elements b0..b3, two per register; row (k) = 2 threadID_in_group + (i & 1), + 8 for
//      i >= 2; col (n) = groupID.
//   C, D: c0..c3, one fp32 per register; row = groupID for i < 2, groupID + 8 otherwise;
//      col = 2 threadID_in_group + (i & 1).
struct RowCol {
  int row, col;
};
RowCol a_element(int lane, int i) {
  return {(lane >> 2) + 8 * ((i >> 1) & 1), 2 * (lane % 4) + (i & 1) + 8 * (i >> 2)};
}
RowCol b_element(int lane, int i) {
  return {2 * (lane % 4) + (i & 1) + 8 * (i >> 1), lane >> 2};
}
RowCol cd_element(int lane, int i) {
  return {(lane >> 2) + 8 * (i >> 1), 2 * (lane % 4) + (i & 1)};
}

double bf16_element(const uint32_t* regs, int i) {
  const uint32_t bits = (regs[i / 2] >> (16 * (i % 2))) & 0xffffu;
  const uint32_t f32 = bits << 16;  // bf16 is the upper half of an fp32
  float x;
  std::memcpy(&x, &f32, 4);
  return x;
}

// The emulator accumulates C + sum_k A B in double (each bf16 product is exact) and rounds once
// to fp32. The PTX ISA leaves the order and intermediate rounding of the hardware's fp32
// accumulation unspecified; the difference is a few fp32 ulps, within the test's tolerances.
void execute_mma_m16n8k16(Warp& w) {
  double a[16][16], b[16][8], c[16][8];
  for (int l = 0; l < kWarpSize; ++l) {
    const uint32_t* in = w.lanes[l].in;  // a: in[0..3], b: in[4..5], c: in[6..9]
    for (int i = 0; i < 8; ++i) {
      const RowCol e = a_element(l, i);
      a[e.row][e.col] = bf16_element(in, i);
    }
    for (int i = 0; i < 4; ++i) {
      const RowCol e = b_element(l, i);
      b[e.row][e.col] = bf16_element(in + 4, i);
    }
    for (int i = 0; i < 4; ++i) {
      const RowCol e = cd_element(l, i);
      float x;
      std::memcpy(&x, &in[6 + i], 4);
      c[e.row][e.col] = x;
    }
  }
  for (int l = 0; l < kWarpSize; ++l)
    for (int i = 0; i < 4; ++i) {
      const RowCol e = cd_element(l, i);
      double acc = c[e.row][e.col];
      for (int k = 0; k < 16; ++k) acc += a[e.row][k] * b[k][e.col];
      const float d = static_cast<float>(acc);
      std::memcpy(&w.lanes[l].out[i], &d, 4);
    }
}

// ---- cp.async -----------------------------------------------------------------------------

// When a cp.async lands, at either end of the window the PTX ISA allows: at the
// cp.async.wait_group that covers it (default; a kernel that reads the destination earlier
// reads stale data) or at issue (CUDA_EMU_CP_ASYNC=issue; a kernel that overwrites a stage
// other threads still read corrupts their data). A correct kernel gives the same results.
bool copies_land_at_issue() {
  static const bool at_issue = [] {
    const char* mode = std::getenv("CUDA_EMU_CP_ASYNC");
    if (mode == nullptr || std::strcmp(mode, "wait") == 0) return false;
    if (std::strcmp(mode, "issue") == 0) return true;
    fail("CUDA_EMU_CP_ASYNC must be 'wait' or 'issue', not '%s'", mode);
  }();
  return at_issue;
}

void complete_copy(const AsyncCopy& copy) {
  unsigned char* dst = cta().smem + copy.dst;
  std::memcpy(dst, copy.src, copy.src_size);
  std::memset(dst + copy.src_size, 0, 16 - copy.src_size);
}

}  // namespace

// ---- public entry points ------------------------------------------------------------------

void run_grid(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem_bytes,
              const std::function<void()>& kernel_body) {
  check_launch(kernel, grid, block, dynamic_smem_bytes);
  if (g_cta != nullptr) fail("nested kernel launch");
  Cta c;
  c.body = &kernel_body;
  c.smem_bytes = dynamic_smem_bytes;
  const size_t alloc = (dynamic_smem_bytes / kSmemAlign + 1) * kSmemAlign;
  std::unique_ptr<unsigned char, decltype(&std::free)> smem(
      static_cast<unsigned char*>(std::aligned_alloc(kSmemAlign, alloc)), &std::free);
  c.smem = smem.get();
  const unsigned n = block.x * block.y * block.z;
  c.threads.resize(n);
  c.warps.resize(n / kWarpSize);
  for (unsigned i = 0; i < n; ++i) {
    Thread& t = c.threads[i];
    t.stack.reset(new char[kStackBytes]);
    t.linear = static_cast<int>(i);
    t.idx = uint3{i % block.x, i / block.x % block.y, i / (block.x * block.y)};
  }
  gridDim = grid;
  blockDim = block;
  g_cta = &c;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = uint3{x, y, z};
        run_cta(c);
      }
  g_cta = nullptr;
}

unsigned char* dynamic_smem() { return cta().smem; }

void register_global(const void* p, size_t bytes) {
  g_global.emplace_back(static_cast<const unsigned char*>(p), bytes);
}

void syncthreads() { arrive_and_wait(cta().barrier, "__syncthreads", [] {}); }

// cvta.to.shared: the offset of a generic address inside the CTA's shared window.
size_t cvta_generic_to_shared(const void* p) {
  const auto* q = static_cast<const unsigned char*>(p);
  if (q < cta().smem || q > cta().smem + cta().smem_bytes)
    fail("__cvta_generic_to_shared of %p: not in the dynamic shared memory", p);
  return static_cast<size_t>(q - cta().smem);
}

uint32_t shfl_xor_sync(uint32_t member_mask, uint32_t value, int lane_mask, int width) {
  if (member_mask != 0xffffffffu || width != kWarpSize || lane_mask < 0 || lane_mask >= kWarpSize)
    fail("__shfl_xor_sync: only full-warp butterflies are emulated (mask %#x, lane mask %d, "
         "width %d)", member_mask, lane_mask, width);
  const uint32_t in[2] = {value, static_cast<uint32_t>(lane_mask)};
  return warp_collective("shfl.sync.bfly.b32", in, 2, execute_shfl_xor).out[0];
}

// cp.async.cg.shared.global [dst], [src], 16, src_size (PTX ISA, "Data Movement and Conversion
// Instructions: cp.async"): copies src_size bytes from global src to shared dst and zero-fills
// the rest of the 16 bytes; both addresses aligned to 16 bytes. The copy is asynchronous: it
// lands at some point before the cp.async.wait_group that covers its group returns.
void cp_async_cg_shared_global_16(uint32_t dst, const void* src, int src_size) {
  const auto* s = static_cast<const unsigned char*>(src);
  check_shared(dst, 16, 16, "cp.async destination");
  if (reinterpret_cast<uintptr_t>(s) % 16 != 0)
    fail("cp.async source %p is not 16-byte aligned", src);
  if (src_size < 0 || src_size > 16) fail("cp.async src-size %d is outside [0, 16]", src_size);
  if (src_size > 0) check_global(s, src_size, "cp.async source");
  const AsyncCopy copy{dst, s, src_size};
  if (copies_land_at_issue()) {
    complete_copy(copy);
  } else {
    self().uncommitted.push_back(copy);
  }
}

// cp.async.commit_group: the thread's cp.async since the previous commit form one group
// (possibly empty).
void cp_async_commit_group() {
  Thread& t = self();
  t.groups.push_back(std::move(t.uncommitted));
  t.uncommitted.clear();
}

// cp.async.wait_group n: waits until at most the n most recent groups of this thread are
// pending, i.e. all older groups have completed. Visibility to other threads needs a barrier.
void cp_async_wait_group(int n) {
  Thread& t = self();
  while (t.groups.size() > static_cast<size_t>(n)) {
    for (const AsyncCopy& copy : t.groups.front()) complete_copy(copy);
    t.groups.pop_front();
  }
}

void ldmatrix_sync_aligned_m8n8_x4_shared_b16(uint32_t (&r)[4], uint32_t addr) {
  const LaneSlot& slot = warp_collective("ldmatrix.sync.aligned.m8n8.x4.shared.b16", &addr, 1,
                                         execute_ldmatrix_x4);
  std::memcpy(r, slot.out, sizeof(r));
}

void mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(float (&d)[4], const uint32_t (&a)[4],
                                                          const uint32_t (&b)[2],
                                                          const float (&c)[4]) {
  uint32_t in[10];
  std::memcpy(in, a, 16);
  std::memcpy(in + 4, b, 8);
  std::memcpy(in + 6, c, 16);
  const LaneSlot& slot = warp_collective("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                                         in, 10, execute_mma_m16n8k16);
  std::memcpy(d, slot.out, 16);
}

}  // namespace cuda_emu

// ---- CUDA runtime functions the launchers call --------------------------------------------

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  if (value < 0 || value > cuda_emu::kMaxDynamicSmemOptIn) return cudaErrorInvalidValue;
  cuda_emu::g_max_dynamic_smem[func] = value;
  return cudaSuccess;
}

// Launch errors abort the run (with a message), so none is ever pending.
cudaError_t cudaGetLastError() { return cudaSuccess; }
