// Scheduler, memory checks and PTX instruction semantics of the host emulation (cuda_host_emu.h).
#include "cuda_host_emu.h"

#include <ucontext.h>

#include <algorithm>
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
constexpr int kWarpgroupSize = 128;  // 4 consecutive warps, the first one's index a multiple of 4
constexpr size_t kStackBytes = 128 << 10;
constexpr unsigned kMaxThreadsPerCta = 1024;
// The CTA's shared window: shared address 0 is its start. Dynamic shared memory starts at
// kDynamicSmemBase, after the 1 KB that sm_90 reserves at the bottom of the window and 16 bytes
// of static shared data, so it is only 16-byte aligned, which is all that
// `extern __shared__ __align__(16)` promises: a kernel that needs a coarser alignment (a TMA
// destination with the 128-byte swizzle: 1024) has to round up itself. The window is allocated
// 1024-byte aligned, so generic and shared addresses agree modulo 1024.
constexpr size_t kWindowAlign = 1024;
constexpr uint32_t kDynamicSmemBase = 1024 + 16;
// Dynamic shared memory per CTA: 48 KB by default, up to the device's opt-in maximum after
// cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize): 163 KB on sm_80, 227 KB on
// sm_90 (CUDA C++ Programming Guide, "Compute Capabilities": technical specifications).
constexpr int kDefaultDynamicSmem = 48 << 10;

int g_cc_major = 8;
int g_cc_minor = 0;

int max_dynamic_smem_opt_in() { return g_cc_major == 9 ? 227 << 10 : 163 << 10; }

[[noreturn]] void fail(const char* fmt, ...) {
  std::va_list args;
  va_start(args, fmt);
  std::fputs("cuda_emu: ", stderr);
  std::vfprintf(stderr, fmt, args);
  std::fputc('\n', stderr);
  va_end(args);
  std::abort();
}

void require_sm90a(const char* what) {
  if (g_cc_major != 9 || g_cc_minor != 0)
    fail("%s needs an sm_90a device; the emulated device has compute capability %d.%d", what,
         g_cc_major, g_cc_minor);
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

// An mbarrier object (PTX ISA, "Parallel Synchronization and Communication Instructions:
// mbarrier"): an expected arrival count, the pending arrival count and the tx-count of the
// current phase. `progress.phase` counts the completed phases; waiting threads block on
// `progress` until it moves on.
struct MBarrier {
  uint32_t expected = 0;
  uint32_t pending = 0;
  int64_t tx = 0;
  Barrier progress;
};

// The fields of a tensor map as tensor_map_encode_tiled stores them in CUtensorMap::opaque.
struct TensorMap {
  uint64_t magic;
  const unsigned char* base;
  uint64_t dim[2];     // elements; dim[0] is the innermost (contiguous) dimension
  uint64_t stride;     // bytes from one dim[1] index to the next
  uint32_t box[2];     // elements
  uint32_t elem_bytes;
  uint32_t swizzle_bytes;  // 0 (none), 32, 64 or 128
};
constexpr uint64_t kTensorMapMagic = 0x70616d726f736e65ull;  // "ensormap"
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap), "the fields fit in the opaque bytes");

// A TMA tensor copy in flight (CUDA_EMU_ASYNC=late): it lands, and completes its bytes on the
// mbarrier, only once no thread can proceed without it.
struct BulkCopy {
  uint32_t dst;
  TensorMap map;
  int c0, c1;
  uint32_t mbar;
};

// One wgmma.mma_async as seen by one warp of the warpgroup: its 16 rows of A, all of B.
struct WgmmaOp {
  uint64_t desc_a, desc_b;
  bool scale_d;
  int scale_a, scale_b;
  int warp;  // within the warpgroup: rows 16 warp .. 16 warp + 15 of the 64
  float* acc[kWarpSize];  // each lane's d registers
  bool loaded = false;
  std::vector<double> a;  // [16][16]
  std::vector<double> b;  // [256][16]
};

struct WarpWgmma {
  bool fenced = false;  // a wgmma.fence since the start or the last wgmma.wait_group
  std::vector<WgmmaOp> uncommitted;
  std::deque<std::vector<WgmmaOp>> groups;  // committed, not yet complete; oldest first
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
  uint32_t blocked_mbar;      // mbarrier waits: the object's address and the awaited parity
  uint32_t blocked_parity;
  bool wait_timed_out;        // CUDA_EMU_TRY_WAIT=time-limit: the scheduler ended its try_wait
  std::vector<AsyncCopy> uncommitted;         // cp.async since the last commit_group
  std::deque<std::vector<AsyncCopy>> groups;  // committed and not yet complete, oldest first

  bool runnable() const {
    return !exited && (blocked_on == nullptr || blocked_on->phase != blocked_phase);
  }
};

// One thread's operands and results of a collective instruction, as 32-bit registers.
struct LaneSlot {
  const char* op;
  uint32_t in[10];  // mma: a[4], b[2], c[4]; ldmatrix: the row address; shfl: value, lane mask;
                    // wgmma: descriptors and immediates
  uint32_t out[4];
  float* acc;       // wgmma: the thread's accumulator registers
};

// The threads of a warp or a warpgroup, for the instructions they execute together.
struct Collective {
  Barrier barrier;
  std::vector<LaneSlot> lanes;
};

struct Warp {
  Collective sync;
  WarpWgmma wgmma;
};

struct Cta {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  std::vector<Collective> warpgroups;
  Barrier barrier;  // __syncthreads
  unsigned char* window = nullptr;  // shared address 0
  unsigned char* smem = nullptr;    // dynamic shared memory, at shared address kDynamicSmemBase
  size_t smem_bytes = 0;
  std::map<uint32_t, MBarrier> mbarriers;  // by shared address
  std::deque<BulkCopy> bulk_copies;        // TMA copies in flight, oldest first
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

void block_on(const Barrier& b, const char* what) {
  Thread& t = self();
  t.blocked_on = &b;
  t.blocked_phase = b.phase;
  t.blocked_at = what;
  swapcontext(&t.context, &cta().scheduler);  // resumed once the barrier has moved on
  t.blocked_on = nullptr;
}

void arrive_and_wait(Barrier& b, const char* what, const std::function<void()>& complete) {
  if (++b.arrived == b.count) {
    complete();
    b.arrived = 0;
    ++b.phase;
    return;
  }
  block_on(b, what);
}

// When asynchronous copies into shared memory land, at either end of the window the PTX ISA
// allows: at the wait that covers them (CUDA_EMU_ASYNC=late, the default: a cp.async at its
// cp.async.wait_group, a TMA copy once no thread can proceed without it; a kernel that reads the
// data earlier reads stale data) or at issue (CUDA_EMU_ASYNC=early; a kernel that overwrites a
// stage which other threads still read corrupts their data). Asynchronous reads of shared memory
// (wgmma operands) go the other way: at issue in the late mode, at their wgmma.wait_group in the
// early one. A correct kernel gives the same results.
bool copies_land_at_issue() {
  static const bool at_issue = [] {
    const char* mode = std::getenv("CUDA_EMU_ASYNC");
    if (mode == nullptr || std::strcmp(mode, "late") == 0) return false;
    if (std::strcmp(mode, "early") == 0) return true;
    fail("CUDA_EMU_ASYNC must be 'late' or 'early', not '%s'", mode);
  }();
  return at_issue;
}

// What an mbarrier.try_wait that can never complete does. suspend (default): the thread stays
// suspended and the run aborts with a deadlock report once no thread can proceed. time-limit: as
// on the hardware, the try_wait returns false once its time limit has passed; the emulator ends
// it then, when nothing else can happen, and moves the global timer on by kTryWaitLimitNs, so a
// kernel's own bound on its waits (tile_gemm_sm90.cuh: mbar_wait) is what stops the run.
bool try_wait_has_time_limit() {
  static const bool limited = [] {
    const char* mode = std::getenv("CUDA_EMU_TRY_WAIT");
    if (mode == nullptr || std::strcmp(mode, "suspend") == 0) return false;
    if (std::strcmp(mode, "time-limit") == 0) return true;
    fail("CUDA_EMU_TRY_WAIT must be 'suspend' or 'time-limit', not '%s'", mode);
  }();
  return limited;
}

// The emulated %globaltimer in ns: one tick per read, plus kTryWaitLimitNs per timed-out try_wait
// (a stand-in for the hardware's system-dependent limit, long enough that a kernel bound of
// seconds is reached in tens of time-outs).
constexpr uint64_t kTryWaitLimitNs = 100000000;  // 0.1 s
uint64_t g_globaltimer_ns = [] {
  const char* start = std::getenv("CUDA_EMU_GLOBALTIMER_START");
  return start == nullptr ? uint64_t{0} : std::strtoull(start, nullptr, 10);
}();

// ---- memory -------------------------------------------------------------------------------

void check_shared(uint32_t addr, size_t bytes, size_t align, const char* what) {
  if (addr % align != 0) fail("%s: shared address %u is not %zu-byte aligned", what, addr, align);
  if (addr < kDynamicSmemBase || addr + bytes > kDynamicSmemBase + cta().smem_bytes)
    fail("%s: shared bytes [%u, %zu) outside the dynamic shared memory [%u, %zu)", what, addr,
         addr + bytes, kDynamicSmemBase, kDynamicSmemBase + cta().smem_bytes);
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
  int exited = 0;
  for (const Thread& t : c.threads) {
    if (t.exited) {
      ++exited;
      continue;
    }
    std::fprintf(stderr, "  thread (%u,%u,%u) waits at %s", t.idx.x, t.idx.y, t.idx.z,
                 t.blocked_at);
    const auto it = c.mbarriers.find(t.blocked_mbar);
    if (t.blocked_on != nullptr && it != c.mbarriers.end() && t.blocked_on == &it->second.progress) {
      const MBarrier& m = it->second;
      std::fprintf(stderr,
                   " for parity %u of the mbarrier at shared %u (completed phases %llu, pending "
                   "arrivals %u of %u, tx-count %lld)",
                   t.blocked_parity, t.blocked_mbar,
                   static_cast<unsigned long long>(m.progress.phase), m.pending, m.expected,
                   static_cast<long long>(m.tx));
    }
    std::fputc('\n', stderr);
  }
  fail("deadlock in CTA (%u,%u,%u): no thread can proceed (%d of %zu threads exited, no TMA copy "
       "in flight)",
       blockIdx.x, blockIdx.y, blockIdx.z, exited, c.threads.size());
}

void start_cta(Cta& c) {
  // Shared memory starts as garbage on the hardware: all-ones bytes read as NaN (bf16 and fp32).
  std::memset(c.window, 0xff, kDynamicSmemBase + c.smem_bytes);
  c.barrier = Barrier{static_cast<int>(c.threads.size())};
  for (Warp& w : c.warps) {
    w.sync.barrier = Barrier{kWarpSize};
    w.wgmma = WarpWgmma{};
  }
  for (size_t g = 0; g < c.warpgroups.size(); ++g)
    c.warpgroups[g].barrier = Barrier{static_cast<int>(
        std::min<size_t>(kWarpgroupSize, c.threads.size() - g * kWarpgroupSize))};
  c.mbarriers.clear();
  c.bulk_copies.clear();
  for (Thread& t : c.threads) {
    t.exited = false;
    t.blocked_on = nullptr;
    t.blocked_at = "";
    t.blocked_mbar = 0;
    t.wait_timed_out = false;
    t.uncommitted.clear();
    t.groups.clear();  // copies never waited for cannot be observed
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = t.stack.get();
    t.context.uc_stack.ss_size = kStackBytes;
    t.context.uc_link = &c.scheduler;
    makecontext(&t.context, thread_main, 0);
  }
}

void land_bulk_copy(const BulkCopy& copy);

// Whether thread t is suspended in an mbarrier.try_wait.
bool waits_on_mbarrier(const Cta& c, const Thread& t) {
  const auto it = c.mbarriers.find(t.blocked_mbar);
  return !t.exited && t.blocked_on != nullptr && it != c.mbarriers.end() &&
         t.blocked_on == &it->second.progress;
}

// Ends every suspended try_wait with false (their time limit has passed); false when none was.
bool end_mbarrier_waits(Cta& c) {
  bool any = false;
  for (Thread& t : c.threads) {
    if (!waits_on_mbarrier(c, t)) continue;
    t.wait_timed_out = true;
    t.blocked_on = nullptr;
    any = true;
  }
  return any;
}

// Always resumes the lowest-numbered thread that can proceed, so that warp 0 runs through a
// whole barrier interval before warp 1 starts it: the most skewed schedule the hardware allows,
// where a missing barrier shows as a warp reading data another warp has not written yet or has
// already overwritten. TMA copies in flight land, oldest first, only when no thread can proceed.
void run_cta(Cta& c) {
  start_cta(c);
  for (;;) {
    size_t i = 0;
    while (i < c.threads.size() && !c.threads[i].runnable()) ++i;
    if (i == c.threads.size()) {
      if (c.bulk_copies.empty() && !(try_wait_has_time_limit() && end_mbarrier_waits(c))) break;
      if (c.bulk_copies.empty()) continue;
      const BulkCopy copy = c.bulk_copies.front();
      c.bulk_copies.pop_front();
      land_bulk_copy(copy);
      continue;
    }
    c.current = static_cast<int>(i);
    threadIdx = c.threads[i].idx;
    swapcontext(&c.scheduler, &c.threads[i].context);
  }
  for (const Thread& t : c.threads)
    if (!t.exited) report_deadlock(c);
  c.current = -1;
  for (size_t w = 0; w < c.warps.size(); ++w)
    if (!c.warps[w].wgmma.uncommitted.empty() || !c.warps[w].wgmma.groups.empty())
      fail("warp %zu of CTA (%u,%u,%u) exited with wgmma operations that no wgmma.wait_group "
           "covered", w, blockIdx.x, blockIdx.y, blockIdx.z);
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

// ---- collectives --------------------------------------------------------------------------

int lane_of(const Thread& t) { return t.linear % kWarpSize; }

// Executes a collective instruction (.sync.aligned) of a warp or a warpgroup: each thread
// deposits its operands, and when all have arrived, `execute` computes the results of every
// thread. Returns this thread's slot, whose `out` holds its results.
LaneSlot& collective(Collective& group, int member, int index, const char* op, const uint32_t* in,
                     int n_in, float* acc, void (*execute)(Collective&, int index)) {
  LaneSlot& slot = group.lanes[member];
  slot.op = op;
  std::memcpy(slot.in, in, n_in * sizeof(uint32_t));
  slot.acc = acc;
  arrive_and_wait(group.barrier, op, [&group, op, execute, index] {
    for (const LaneSlot& s : group.lanes)
      if (std::strcmp(s.op, op) != 0)
        fail("threads of one %s at different collectives: %s and %s",
             group.lanes.size() == kWarpSize ? "warp" : "warpgroup", op, s.op);
    execute(group, index);
  });
  return slot;
}

LaneSlot& warp_collective(const char* op, const uint32_t* in, int n_in,
                          void (*execute)(Collective&, int warp)) {
  Thread& t = self();
  const int warp = t.linear / kWarpSize;
  return collective(cta().warps[warp].sync, lane_of(t), warp, op, in, n_in, nullptr, execute);
}

// A warpgroup is 4 contiguous warps, the first warp's index a multiple of 4 (PTX ISA,
// "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions").
LaneSlot& warpgroup_collective(const char* op, const uint32_t* in, int n_in, float* acc,
                               void (*execute)(Collective&, int warpgroup)) {
  Thread& t = self();
  const int g = t.linear / kWarpgroupSize;
  Collective& group = cta().warpgroups[g];
  if (group.barrier.count != kWarpgroupSize)
    fail("%s in a CTA of %zu threads: its last warpgroup is incomplete", op, cta().threads.size());
  return collective(group, t.linear % kWarpgroupSize, g, op, in, n_in, acc, execute);
}

// shfl.sync.bfly.b32 with a full member mask (PTX ISA, "Data Movement and Conversion
// Instructions: shfl.sync"): lane l reads the value of lane l ^ lane_mask.
void execute_shfl_xor(Collective& w, int) {
  for (int l = 0; l < kWarpSize; ++l) w.lanes[l].out[0] = w.lanes[l ^ w.lanes[l].in[1]].in[0];
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (PTX ISA, "Warp-level matrix load instruction:
// ldmatrix"): four 8x8 matrices of 16-bit elements. Lanes 8j .. 8j+7 hold the addresses of rows
// 0..7 of matrix j; a row is 8 contiguous elements (16 bytes, 16-byte aligned). Lane l receives
// in register j the elements (row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1) of matrix j, the
// lower column in the lower half.
void execute_ldmatrix_x4(Collective& w, int) {
  const unsigned char* window = cta().window;
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < 8; ++r)
      check_shared(w.lanes[8 * j + r].in[0], 16, 16, "ldmatrix row");
  for (int l = 0; l < kWarpSize; ++l)
    for (int j = 0; j < 4; ++j) {
      const uint32_t row = w.lanes[8 * j + l / 4].in[0];
      std::memcpy(&w.lanes[l].out[j], window + row + 4 * (l % 4), 4);
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

double bf16_bits(uint32_t bits) {
  const uint32_t f32 = (bits & 0xffffu) << 16;  // bf16 is the upper half of an fp32
  float x;
  std::memcpy(&x, &f32, 4);
  return x;
}

double bf16_element(const uint32_t* regs, int i) { return bf16_bits(regs[i / 2] >> (16 * (i % 2))); }

// The emulator accumulates C + sum_k A B in double (each bf16 product is exact) and rounds once
// to fp32. The PTX ISA leaves the order and intermediate rounding of the hardware's fp32
// accumulation unspecified; the difference is a few fp32 ulps, within the test's tolerances.
void execute_mma_m16n8k16(Collective& w, int) {
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

void complete_copy(const AsyncCopy& copy) {
  unsigned char* dst = cta().window + copy.dst;
  std::memcpy(dst, copy.src, copy.src_size);
  std::memset(dst + copy.src_size, 0, 16 - copy.src_size);
}

// ---- mbarrier -----------------------------------------------------------------------------
// PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier". An mbarrier
// object is an opaque 64-bit, 8-byte aligned object in shared memory; the emulator keeps its
// state beside the shared memory, by address. mbarrier.init sets the expected arrival count
// (1 .. 2^20 - 1), the pending count to it, the tx-count to 0 and the phase to 0. An arrive-on
// operation decrements the pending count; expect-tx(n) increments the tx-count by n and
// complete-tx(n), done by an asynchronous transaction such as a TMA copy, decrements it (its
// valid range is [-(2^20 - 1), 2^20 - 1]). The current phase completes when the pending count is
// 0 and the tx-count is 0: then the phase advances and the pending count is reset to the
// expected count ("Phase Completion of the mbarrier object").

constexpr int64_t kMaxTxCount = (1 << 20) - 1;

MBarrier& mbarrier_at(uint32_t addr, const char* what) {
  check_shared(addr, 8, 8, what);
  const auto it = cta().mbarriers.find(addr);
  if (it == cta().mbarriers.end())
    fail("%s: no mbarrier was initialised at shared address %u", what, addr);
  return it->second;
}

void complete_phase_if_done(MBarrier& m) {
  if (m.pending == 0 && m.tx == 0) {
    m.pending = m.expected;
    ++m.progress.phase;  // releases the threads waiting for this phase
  }
}

void change_tx(MBarrier& m, int64_t delta, const char* what) {
  m.tx += delta;
  if (m.tx > kMaxTxCount || m.tx < -kMaxTxCount)
    fail("%s: the mbarrier's tx-count %lld left [-(2^20 - 1), 2^20 - 1]", what,
         static_cast<long long>(m.tx));
}

void arrive_on(MBarrier& m, const char* what) {
  if (m.pending == 0)
    fail("%s: arrive-on an mbarrier whose current phase has no pending arrival left (more "
         "arrivals than its count)", what);
  --m.pending;
  complete_phase_if_done(m);
}

// ---- TMA tensor copies --------------------------------------------------------------------
// PTX ISA, "Data Movement and Conversion Instructions: cp.async.bulk.tensor" and "Tensors"
// ("Tensor-map", "Bounding Box", "Out of Bounds Access", "Shared memory swizzling modes").
// A tiled 2-D load copies the box of box[1] rows x box[0] elements whose corner is at tensor
// coordinates (c0, c1) (c0 innermost) into shared memory, row after row, each row box[0] *
// element-size bytes. Elements outside the tensor (either coordinate < 0 or >= its dimension)
// are filled with zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE). The copy completes the box's full
// size in bytes, out-of-bounds elements included, as complete-tx on the mbarrier.
// Swizzling permutes the 16-byte chunks of each `span`-byte row of the shared destination: the
// chunk index, bits [4, 4 + log2(span / 16)) of the shared address, is XORed with the same
// number of bits from bit 7 up (the row within the 8-row repeating pattern). For the 128-byte
// mode: bits [4:6] ^= bits [7:9], a pattern that repeats every 1024 bytes, so the destination
// must be 1024-byte aligned (128 bytes without swizzle, 256/512 for the 32/64-byte modes).

uint32_t swizzle(uint32_t addr, uint32_t span_bytes) {
  if (span_bytes == 0) return addr;
  const uint32_t mask = span_bytes / 16 - 1;  // 1, 3 or 7
  return addr ^ (((addr >> 7) & mask) << 4);
}

const TensorMap& decode_tensor_map(const CUtensorMap* map, const char* what) {
  if (reinterpret_cast<uintptr_t>(map) % 64 != 0)
    fail("%s: the tensor map at %p is not 64-byte aligned", what, static_cast<const void*>(map));
  const auto* m = reinterpret_cast<const TensorMap*>(map->opaque);
  if (m->magic != kTensorMapMagic)
    fail("%s: %p does not hold a tensor map made by cuTensorMapEncodeTiled", what,
         static_cast<const void*>(map));
  return *m;
}

uint32_t box_bytes(const TensorMap& m) { return m.box[0] * m.box[1] * m.elem_bytes; }

void land_bulk_copy(const BulkCopy& copy) {
  const TensorMap& m = copy.map;
  const uint32_t row_bytes = m.box[0] * m.elem_bytes;
  check_shared(copy.dst, box_bytes(m), 1, "cp.async.bulk.tensor destination");
  for (uint32_t r = 0; r < m.box[1]; ++r) {
    const int64_t gr = int64_t{copy.c1} + r;
    const bool row_in = gr >= 0 && gr < static_cast<int64_t>(m.dim[1]);
    const unsigned char* src_row = m.base + (row_in ? gr : 0) * m.stride;
    // the row's elements inside the tensor: [lo, hi) of the box
    const int64_t lo = std::max<int64_t>(0, -int64_t{copy.c0});
    const int64_t hi = std::min<int64_t>(m.box[0], static_cast<int64_t>(m.dim[0]) - copy.c0);
    if (row_in && lo < hi)
      check_global(src_row + (copy.c0 + lo) * m.elem_bytes, (hi - lo) * m.elem_bytes,
                   "cp.async.bulk.tensor source");
    for (uint32_t c = 0; c < m.box[0]; ++c) {
      unsigned char* dst =
          cta().window + swizzle(copy.dst + r * row_bytes + c * m.elem_bytes, m.swizzle_bytes);
      if (row_in && static_cast<int64_t>(c) >= lo && static_cast<int64_t>(c) < hi) {
        std::memcpy(dst, src_row + (copy.c0 + int64_t{c}) * m.elem_bytes, m.elem_bytes);
      } else {
        std::memset(dst, 0, m.elem_bytes);
      }
    }
  }
  MBarrier& bar = mbarrier_at(copy.mbar, "cp.async.bulk.tensor completion mbarrier");
  change_tx(bar, -int64_t{box_bytes(m)}, "cp.async.bulk.tensor complete-tx");
  complete_phase_if_done(bar);
}

// ---- wgmma ----------------------------------------------------------------------------------
// PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions".
//
// Matrix descriptor ("Shared Memory Matrix Layout: Matrix Descriptor Format"), 64 bits:
//   bits  0-13: matrix start address, (addr & 0x3FFFF) >> 4
//   bits 16-29: leading dimension byte offset >> 4
//   bits 32-45: stride dimension byte offset >> 4
//   bits 49-51: matrix base offset (0 when the swizzle pattern starts on its repeat boundary)
//   bits 62-63: swizzle mode: 0 none (interleave), 1 128-byte, 2 64-byte, 3 32-byte
// The other bits are reserved (0). Only what the kernels use is emulated, and anything else
// aborts: K-major operands (imm-trans 0) in the 128-byte swizzle mode with base offset 0.
// There the rows of the operand are 128-byte lines of the swizzle pattern, 8 lines (1024 bytes)
// to a repeating group and SBO bytes from one 8-row group to the next; the 16 K elements of one
// instruction (32 bytes) lie within a line, so LBO is not used. Element (row r, k) is at the
// logical address start + (r / 8) SBO + (r % 8) 128 + 2 k, which the 128-byte swizzle maps to
// shared memory as for a TMA write (above). The emulator requires the start address to lie in
// the first line of a 1024-byte group (start + 32 k for the K steps of a 1024-aligned tile), where
// base offset 0 is right however the hardware counts the pattern's rows.
//
// Accumulator D of .m64nNk16 with .f32 ("Register Fragments and Shared Memory Matrix Layouts:
// Matrix Fragments for wgmma.mma_async.m64nNk16"): N/2 registers per thread; for thread t of the
// warpgroup, warp w = t / 32 and lane l = t % 32, register d[4 j + 2 h + e] (j = 0 .. N/8 - 1,
// h, e in {0, 1}) holds row 16 w + l / 4 + 8 h, column 8 j + 2 (l % 4) + e.
//
// wgmma.mma_async computes D = A B^T + (scale-d ? D : 0) asynchronously; the PTX ISA makes its
// register and shared-memory accesses complete only at the wgmma.wait_group that covers its
// wgmma-group (wgmma.commit_group closes a group; wait_group N waits until at most the N most
// recent groups are pending). Accessing the accumulator registers before that is undefined, as
// is modifying the shared memory it reads. The emulator records the operation at issue, reads the
// operands at issue (CUDA_EMU_ASYNC=late) or at the wait (early) and writes D only at the wait.
// wgmma.fence
// must come before the first wgmma.mma_async and between register accesses and a
// wgmma.mma_async on the same registers: the emulator requires one since the warp's last
// wgmma.wait_group (after which the kernel reads its accumulators), a slightly stricter rule.

constexpr int kWgmmaM = 64, kWgmmaN = 256, kWgmmaK = 16;

struct Descriptor {
  uint32_t start, lbo, sbo;
};

Descriptor decode_descriptor(uint64_t desc, const char* which) {
  constexpr uint64_t kReserved = (uint64_t{3} << 14) | (uint64_t{3} << 30) |
                                 (uint64_t{7} << 46) | (uint64_t{0x3ff} << 52);
  if (desc & kReserved)
    fail("wgmma %s descriptor %#llx: reserved bits set", which, static_cast<unsigned long long>(desc));
  const Descriptor d{static_cast<uint32_t>(desc & 0x3fff) << 4,
                     static_cast<uint32_t>((desc >> 16) & 0x3fff) << 4,
                     static_cast<uint32_t>((desc >> 32) & 0x3fff) << 4};
  const int base_offset = static_cast<int>((desc >> 49) & 7);
  const int mode = static_cast<int>(desc >> 62);
  if (mode != 1)
    fail("wgmma %s descriptor: swizzle mode %d; only the 128-byte swizzle (1) is emulated", which,
         mode);
  if (base_offset != 0)
    fail("wgmma %s descriptor: base offset %d; only 0 is emulated", which, base_offset);
  if ((d.start >> 7) & 7)
    fail("wgmma %s descriptor: start address %u is in line %u of its 1024-byte swizzle group; "
         "only line 0 is emulated", which, d.start, (d.start >> 7) & 7);
  if (d.start % 128 + 2 * kWgmmaK > 128)
    fail("wgmma %s descriptor: the K slice [%u, %u) crosses a 128-byte swizzle line", which,
         d.start, d.start + 2 * kWgmmaK);
  return d;
}

// rows [row0, row0 + rows) x 16 of a K-major, 128-byte swizzled operand, as doubles.
void read_operand(uint64_t desc, int row0, int rows, std::vector<double>& out) {
  const Descriptor d = decode_descriptor(desc, "operand");
  out.resize(static_cast<size_t>(rows) * kWgmmaK);
  for (int r = 0; r < rows; ++r) {
    const int row = row0 + r;
    const uint32_t line = d.start + (row / 8) * d.sbo + (row % 8) * 128;
    check_shared(line & ~127u, 128, 1, "wgmma operand");
    for (int k = 0; k < kWgmmaK; ++k) {
      uint16_t bits;
      std::memcpy(&bits, cta().window + swizzle(line + 2 * k, 128), 2);
      out[static_cast<size_t>(r) * kWgmmaK + k] = bf16_bits(bits);
    }
  }
}

void load_operands(WgmmaOp& op) {
  read_operand(op.desc_a, 16 * op.warp, 16, op.a);
  read_operand(op.desc_b, 0, kWgmmaN, op.b);
  op.loaded = true;
}

// Completes one wgmma for the 32 lanes of a warp: d = A B^T (+ d), accumulated in double and
// rounded once to fp32, as for mma.sync.
void complete_wgmma(WgmmaOp& op) {
  if (!op.loaded) load_operands(op);
  for (int l = 0; l < kWarpSize; ++l) {
    float* d = op.acc[l];
    for (int i = 0; i < kWgmmaN / 2; ++i) {
      const int j = i / 4, h = (i / 2) % 2, e = i % 2;
      const int row = l / 4 + 8 * h;  // within the warp's 16 rows
      const int col = 8 * j + 2 * (l % 4) + e;
      double acc = op.scale_d ? d[i] : 0.0;
      const double* a = &op.a[static_cast<size_t>(row) * kWgmmaK];
      const double* b = &op.b[static_cast<size_t>(col) * kWgmmaK];
      double sum = 0.0;
      for (int k = 0; k < kWgmmaK; ++k) sum += a[k] * b[k];
      acc += op.scale_a * op.scale_b * sum;
      d[i] = static_cast<float>(acc);
    }
  }
}

void execute_wgmma_fence(Collective&, int warp) { cta().warps[warp].wgmma.fenced = true; }

void execute_wgmma_commit(Collective&, int warp) {
  WarpWgmma& s = cta().warps[warp].wgmma;
  s.groups.push_back(std::move(s.uncommitted));
  s.uncommitted.clear();
}

void execute_wgmma_wait(Collective& w, int warp) {
  WarpWgmma& s = cta().warps[warp].wgmma;
  const size_t n = w.lanes[0].in[0];
  for (const LaneSlot& lane : w.lanes)
    if (lane.in[0] != n) fail("wgmma.wait_group: lanes of one warp wait for different counts");
  while (s.groups.size() > n) {
    for (WgmmaOp& op : s.groups.front()) complete_wgmma(op);
    s.groups.pop_front();
  }
  s.fenced = false;
}

uint64_t slot_u64(const LaneSlot& s, int i) { return s.in[i] | (uint64_t{s.in[i + 1]} << 32); }

// in: desc_a (2 words), desc_b (2), scale-d, imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b
void execute_wgmma_mma(Collective& g, int warpgroup) {
  const LaneSlot& first = g.lanes[0];
  for (const LaneSlot& s : g.lanes)
    if (std::memcmp(s.in, first.in, 9 * sizeof(uint32_t)) != 0)
      fail("wgmma.mma_async: the threads of warpgroup %d pass different descriptors or "
           "immediates", warpgroup);
  const uint64_t desc_a = slot_u64(first, 0), desc_b = slot_u64(first, 2);
  const int scale_a = static_cast<int>(first.in[5]), scale_b = static_cast<int>(first.in[6]);
  if ((scale_a != 1 && scale_a != -1) || (scale_b != 1 && scale_b != -1))
    fail("wgmma.mma_async: imm-scale-a/b must be 1 or -1");
  if (first.in[7] != 0 || first.in[8] != 0)
    fail("wgmma.mma_async: only K-major operands (imm-trans-a = imm-trans-b = 0) are emulated");
  decode_descriptor(desc_a, "A");
  decode_descriptor(desc_b, "B");
  for (int w = 0; w < 4; ++w) {
    WarpWgmma& s = cta().warps[4 * warpgroup + w].wgmma;
    if (!s.fenced)
      fail("wgmma.mma_async in warp %d without a wgmma.fence since its last wgmma.wait_group",
           4 * warpgroup + w);
    WgmmaOp op{desc_a, desc_b, first.in[4] != 0, scale_a, scale_b, w, {}, false, {}, {}};
    for (int l = 0; l < kWarpSize; ++l) op.acc[l] = g.lanes[32 * w + l].acc;
    if (!copies_land_at_issue()) load_operands(op);  // else at the wgmma.wait_group
    s.uncommitted.push_back(std::move(op));
  }
}

// setmaxnreg.{inc,dec}.sync.aligned.u32 (PTX ISA, "Miscellaneous Instructions: setmaxnreg"):
// all warps of the warpgroup execute the same one; the count is in [24, 256] and a multiple of
// 8. It changes no value the emulator holds.
void execute_setmaxnreg(Collective& g, int warpgroup) {
  const uint32_t count = g.lanes[0].in[0];
  for (const LaneSlot& s : g.lanes)
    if (s.in[0] != count)
      fail("setmaxnreg: the threads of warpgroup %d ask for different counts", warpgroup);
  if (count < 24 || count > 256 || count % 8 != 0)
    fail("setmaxnreg: count %u is not a multiple of 8 in [24, 256]", count);
}

}  // namespace

// ---- public entry points ------------------------------------------------------------------

void set_compute_capability(int major, int minor) {
  if (!((major == 8 && minor == 0) || (major == 9 && minor == 0)))
    fail("only compute capabilities 8.0 and 9.0 are emulated, not %d.%d", major, minor);
  g_cc_major = major;
  g_cc_minor = minor;
}

void run_grid(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem_bytes,
              const std::function<void()>& kernel_body) {
  check_launch(kernel, grid, block, dynamic_smem_bytes);
  if (g_cta != nullptr) fail("nested kernel launch");
  Cta c;
  c.body = &kernel_body;
  c.smem_bytes = dynamic_smem_bytes;
  const size_t alloc = ((kDynamicSmemBase + dynamic_smem_bytes) / kWindowAlign + 1) * kWindowAlign;
  std::unique_ptr<unsigned char, decltype(&std::free)> window(
      static_cast<unsigned char*>(std::aligned_alloc(kWindowAlign, alloc)), &std::free);
  c.window = window.get();
  c.smem = c.window + kDynamicSmemBase;
  const unsigned n = block.x * block.y * block.z;
  c.threads.resize(n);
  c.warps.resize(n / kWarpSize);
  for (Warp& w : c.warps) w.sync.lanes.resize(kWarpSize);
  c.warpgroups.resize((n + kWarpgroupSize - 1) / kWarpgroupSize);
  for (Collective& g : c.warpgroups) g.lanes.resize(kWarpgroupSize);
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
  return static_cast<size_t>(q - cta().window);
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

// ---- sm_90a ---------------------------------------------------------------------------------

void mbarrier_init_shared_cta_b64(uint32_t addr, uint32_t count) {
  check_shared(addr, 8, 8, "mbarrier.init");
  if (count < 1 || count > kMaxTxCount) fail("mbarrier.init: count %u outside [1, 2^20 - 1]", count);
  MBarrier& m = cta().mbarriers[addr];
  m.expected = m.pending = count;
  m.tx = 0;
  m.progress.phase = 0;
}

// mbarrier.arrive.shared::cta.b64 _, [addr]: an arrive-on operation (count 1).
void mbarrier_arrive_shared_cta_b64(uint32_t addr) {
  arrive_on(mbarrier_at(addr, "mbarrier.arrive"), "mbarrier.arrive");
}

// mbarrier.arrive.expect_tx.shared::cta.b64 _, [addr], tx_count: expect-tx(tx_count), then an
// arrive-on operation.
void mbarrier_arrive_expect_tx_shared_cta_b64(uint32_t addr, uint32_t tx_count) {
  require_sm90a("mbarrier.arrive.expect_tx");
  MBarrier& m = mbarrier_at(addr, "mbarrier.arrive.expect_tx");
  change_tx(m, tx_count, "mbarrier.arrive.expect_tx");
  arrive_on(m, "mbarrier.arrive.expect_tx");
}

// mbarrier.try_wait.parity.shared::cta.b64 waitComplete, [addr], phaseParity: true when the phase
// of the given parity has completed, i.e. when the current (incomplete) phase has the other
// parity. A fresh barrier is in phase 0, so parity 1 counts as complete. try_wait is potentially
// blocking: the thread may be suspended until the phase completes or a time limit passes; the
// emulator suspends it for as long as that takes (other threads run, TMA copies land), so it
// returns true, unless CUDA_EMU_TRY_WAIT=time-limit and the phase can no longer complete.
bool mbarrier_try_wait_parity_shared_cta_b64(uint32_t addr, uint32_t parity) {
  require_sm90a("mbarrier.try_wait");
  if (parity > 1) fail("mbarrier.try_wait.parity: phaseParity %u is not 0 or 1", parity);
  MBarrier& m = mbarrier_at(addr, "mbarrier.try_wait.parity");
  if ((m.progress.phase & 1) != parity) return true;
  Thread& t = self();
  t.blocked_mbar = addr;
  t.blocked_parity = parity;
  block_on(m.progress, "mbarrier.try_wait.parity");
  if (t.wait_timed_out) {
    t.wait_timed_out = false;
    g_globaltimer_ns += kTryWaitLimitNs;
    return false;
  }
  return true;
}

// mov.u64 %r, %globaltimer
uint64_t globaltimer() { return ++g_globaltimer_ns; }

// fence.mbarrier_init.release.cluster: orders the mbarrier.init before later accesses from
// other CTAs of the cluster; nothing to do for one CTA run in program order.
void fence_mbarrier_init_release_cluster() { require_sm90a("fence.mbarrier_init"); }

void cp_async_bulk_tensor_2d_shared_cluster_global_tile_mbarrier_complete_tx_bytes(uint32_t dst,
                                                                          const CUtensorMap* tensor_map,
                                                                          int c0, int c1,
                                                                          uint32_t mbar) {
  const char* what = "cp.async.bulk.tensor.2d";
  require_sm90a(what);
  const TensorMap& map = decode_tensor_map(tensor_map, what);
  const size_t align = map.swizzle_bytes == 0 ? 128 : 8 * map.swizzle_bytes;
  check_shared(dst, box_bytes(map), align, "cp.async.bulk.tensor destination");
  for (const auto& [addr, unused] : cta().mbarriers)
    if (addr + 8 > dst && addr < dst + box_bytes(map))
      fail("%s: the destination [%u, %u) overlaps the mbarrier at %u", what, dst,
           dst + box_bytes(map), addr);
  mbarrier_at(mbar, "cp.async.bulk.tensor mbarrier");
  const BulkCopy copy{dst, map, c0, c1, mbar};
  if (copies_land_at_issue()) {
    land_bulk_copy(copy);
  } else {
    cta().bulk_copies.push_back(copy);
  }
}

// wgmma.fence.sync.aligned, wgmma.commit_group.sync.aligned, wgmma.wait_group.sync.aligned N:
// each warp waits for its 32 lanes (.sync); .aligned makes all threads of the warpgroup execute
// the same instruction. The pending operations are per warp: each warp's own accumulator rows.
void wgmma_fence_sync_aligned() {
  require_sm90a("wgmma.fence");
  warp_collective("wgmma.fence.sync.aligned", nullptr, 0, execute_wgmma_fence);
}

void wgmma_commit_group_sync_aligned() {
  require_sm90a("wgmma.commit_group");
  warp_collective("wgmma.commit_group.sync.aligned", nullptr, 0, execute_wgmma_commit);
}

void wgmma_wait_group_sync_aligned(int n) {
  require_sm90a("wgmma.wait_group");
  if (n < 0) fail("wgmma.wait_group %d", n);
  const uint32_t in = static_cast<uint32_t>(n);
  warp_collective("wgmma.wait_group.sync.aligned", &in, 1, execute_wgmma_wait);
}

// A warpgroup collective: the operation needs the descriptors and registers of all 128 threads
// (each warp holds 16 of the 64 rows of D), so all of them must issue it.
void wgmma_mma_async_sync_aligned_m64n256k16_f32_bf16_bf16(float (&d)[128], uint64_t desc_a,
                                                           uint64_t desc_b, int scale_d,
                                                           int imm_scale_a, int imm_scale_b,
                                                           int imm_trans_a, int imm_trans_b) {
  require_sm90a("wgmma.mma_async");
  static_assert(kWgmmaM * kWgmmaN / kWarpgroupSize == 128, "m64n256 f32: 128 registers a thread");
  const uint32_t in[9] = {static_cast<uint32_t>(desc_a), static_cast<uint32_t>(desc_a >> 32),
                          static_cast<uint32_t>(desc_b), static_cast<uint32_t>(desc_b >> 32),
                          static_cast<uint32_t>(scale_d != 0), static_cast<uint32_t>(imm_scale_a),
                          static_cast<uint32_t>(imm_scale_b), static_cast<uint32_t>(imm_trans_a),
                          static_cast<uint32_t>(imm_trans_b)};
  warpgroup_collective("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", in, 9, d,
                       execute_wgmma_mma);
}

void setmaxnreg_inc_sync_aligned_u32(uint32_t count) {
  require_sm90a("setmaxnreg");
  warpgroup_collective("setmaxnreg.inc.sync.aligned.u32", &count, 1, nullptr, execute_setmaxnreg);
}

void setmaxnreg_dec_sync_aligned_u32(uint32_t count) {
  require_sm90a("setmaxnreg");
  warpgroup_collective("setmaxnreg.dec.sync.aligned.u32", &count, 1, nullptr, execute_setmaxnreg);
}

void trap() {
  std::fflush(stdout);  // what the kernel printed before it trapped
  const Thread& t = self();
  fail("__trap() in thread (%u,%u,%u) of CTA (%u,%u,%u)", t.idx.x, t.idx.y, t.idx.z, blockIdx.x,
       blockIdx.y, blockIdx.z);
}

// cuTensorMapEncodeTiled (CUDA Driver API, "Tensor Map Object Management"), for what the
// emulated TMA copies support: rank 2, unit element strides, no interleave, zero fill out of
// bounds; the other arguments are checked as the driver documents and rejected with
// CUDA_ERROR_INVALID_VALUE: a 16-byte aligned global address; dimensions in [1, 2^32]; strides
// multiples of 16 below 2^40; box sizes in [1, 256], the inner one a multiple of 16 bytes and,
// with a swizzle, at most the swizzle span; element strides in [1, 8].
CUresult tensor_map_encode_tiled(CUtensorMap* tensor_map, CUtensorMapDataType data_type,
                                 cuuint32_t rank, void* global_address, const cuuint64_t* global_dim,
                                 const cuuint64_t* global_strides, const cuuint32_t* box_dim,
                                 const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                 CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
                                 CUtensorMapFloatOOBfill oob_fill) {
  (void)l2_promotion;  // a cache hint
  if (tensor_map == nullptr || global_address == nullptr || global_dim == nullptr ||
      global_strides == nullptr || box_dim == nullptr || element_strides == nullptr)
    return CUDA_ERROR_INVALID_VALUE;
  if (rank != 2) fail("cuTensorMapEncodeTiled: only rank 2 is emulated, not %u", rank);
  if (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE)
    fail("cuTensorMapEncodeTiled: only CU_TENSOR_MAP_INTERLEAVE_NONE is emulated");
  if (oob_fill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    fail("cuTensorMapEncodeTiled: only CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE is emulated");
  TensorMap m{};
  m.magic = kTensorMapMagic;
  m.base = static_cast<const unsigned char*>(global_address);
  switch (data_type) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: m.elem_bytes = 1; break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: m.elem_bytes = 2; break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32: m.elem_bytes = 4; break;
    default: fail("cuTensorMapEncodeTiled: data type %d is not emulated", static_cast<int>(data_type));
  }
  switch (swizzle) {
    case CU_TENSOR_MAP_SWIZZLE_NONE: m.swizzle_bytes = 0; break;
    case CU_TENSOR_MAP_SWIZZLE_32B: m.swizzle_bytes = 32; break;
    case CU_TENSOR_MAP_SWIZZLE_64B: m.swizzle_bytes = 64; break;
    case CU_TENSOR_MAP_SWIZZLE_128B: m.swizzle_bytes = 128; break;
    default: fail("cuTensorMapEncodeTiled: swizzle mode %d is not emulated", static_cast<int>(swizzle));
  }
  if (reinterpret_cast<uintptr_t>(global_address) % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < 2; ++i) {
    if (global_dim[i] == 0 || global_dim[i] > (cuuint64_t{1} << 32)) return CUDA_ERROR_INVALID_VALUE;
    if (box_dim[i] == 0 || box_dim[i] > 256) return CUDA_ERROR_INVALID_VALUE;
    if (element_strides[i] == 0 || element_strides[i] > 8) return CUDA_ERROR_INVALID_VALUE;
    if (element_strides[i] != 1) fail("cuTensorMapEncodeTiled: only unit element strides are emulated");
    m.dim[i] = global_dim[i];
    m.box[i] = box_dim[i];
  }
  if (global_strides[0] % 16 != 0 || global_strides[0] >= (cuuint64_t{1} << 40))
    return CUDA_ERROR_INVALID_VALUE;
  if (global_strides[0] < global_dim[0] * m.elem_bytes) return CUDA_ERROR_INVALID_VALUE;
  m.stride = global_strides[0];
  const uint32_t inner_bytes = m.box[0] * m.elem_bytes;
  if (inner_bytes % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
  if (m.swizzle_bytes != 0 && inner_bytes > m.swizzle_bytes) return CUDA_ERROR_INVALID_VALUE;
  std::memset(tensor_map->opaque, 0, sizeof(tensor_map->opaque));
  std::memcpy(tensor_map->opaque, &m, sizeof(m));
  return CUDA_SUCCESS;
}

CUresult get_error_name(CUresult error, const char** name) {
  switch (error) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    default: *name = nullptr; return CUDA_ERROR_INVALID_VALUE;
  }
}

}  // namespace cuda_emu

// ---- CUDA runtime functions the launchers call --------------------------------------------

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  if (value < 0 || value > cuda_emu::max_dynamic_smem_opt_in()) return cudaErrorInvalidValue;
  cuda_emu::g_max_dynamic_smem[func] = value;
  return cudaSuccess;
}

// Launch errors abort the run (with a message), so none is ever pending.
cudaError_t cudaGetLastError() { return cudaSuccess; }
