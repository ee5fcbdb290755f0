// Runs the host launchers of csrc/ (built for the host emulator, cuda_host_emu.h) on inputs
// from raw little-endian files, and writes the outputs next to them. Used by
// tests/kernels/test_kernels_emulated.py; every array is a file DIR/<name>.bin.
//
//   run_kernels forward  MAINLOOP DIR T H rows valid_v vocab_start inv_tau num_splits [ld]
//       in: hidden [T,H] bf16, weight [rows,H] bf16, labels [T] int64
//       out: part [3,num_splits,T] f32, label_logit [T] f32; with ld (the storing variant of the
//       training path) also logits [T,ld] f32
//   run_kernels softmax_grad DIR T valid_v vocab_start inv_tau ld_logits ld_dz [truncated]
//       in: logits [T,ld_logits] f32, labels, lse, mean_z, g_lp, g_ent [T] f32; with truncated = 1
//       also theta [T] f32 (the truncation thresholds; else the launch gets none)
//       out: dz [T,ld_dz] bf16
//   run_kernels backward MAINLOOP DIR T H rows valid_v vocab_start inv_tau col_begin col_count ld
//               [truncated]
//       in: hidden, weight, labels, lse, mean_z, g_lp, g_ent [T] f32; theta [T] f32 as above
//       out: dz [T,ld] bf16
//   MAINLOOP: sm80 (launch_logprob_*, mma.sync) or sm90 (launch_logprob_*_sm90, TMA + wgmma, on
//   an emulated device of compute capability 9.0). Both take the CTA order's token blocks per
//   group from the environment's CTA_GROUP (default kDefaultCtaGroup).
//   run_kernels cta_order COLS ROWS GROUP
//       launches a grid of cta_order.cuh's grouped_grid and prints, in the order the CTAs run (the
//       emulator's is the GPU's dispatch order: x fastest, then y, then z), the (column block,
//       token block) of each CTA that has a tile, a line "COL ROW" each
//   run_kernels ppo DIR T eps_low eps_high dual_clip behav_cap has_prox
//       in: logp, old_logp, adv [T] f32, mask [T] bool, prox_logp [T] f32 when has_prox
//       out: loss_tok, grad_tok [T] f32, stats [kNumPPOStats] f32
//   run_kernels tma_refused
//       the sm_90a forward on a hidden [5,64] that starts 2 bytes into its buffer: TMA needs a
//       16-byte aligned address, so the tensor map is refused and the run fails with the launch's
//       error and its detail (bindings.cpp puts the same text in the exception)
//   run_kernels mbar_hang BLOCK_X BLOCK_Y THREAD
//       a grid of 3 x 2 CTAs of 64 threads on an emulated sm_90a device, where thread THREAD of
//       CTA (BLOCK_X, BLOCK_Y) waits, through sm90::mbar_wait, for an mbarrier phase that never
//       completes (tile_gemm_sm90.cuh's bounded wait; CUDA_EMU_TRY_WAIT picks what the try_wait
//       does meanwhile)
//
// Outputs start as bindings.cpp leaves them (label_logit zeroed, stats zero with +inf for the
// min); those the kernel must overwrite everywhere start as NaN, so a missed element shows.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "cta_order.cuh"
#include "cuda_host_emu.h"
#include "kernels.h"
#include "tile_gemm_sm90.cuh"

namespace {

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "run_kernels: %s\n", msg.c_str());
  std::exit(2);
}

// A device buffer: host memory registered with the emulator as global memory.
template <class T>
struct Buffer {
  std::vector<T> data;
  Buffer(size_t n, T fill) : data(n, fill) {
    cuda_emu::register_global(data.data(), n * sizeof(T));
  }
  T* get() { return data.data(); }
};

template <class T>
Buffer<T> load(const std::string& dir, const std::string& name, size_t n) {
  Buffer<T> buf(n, T{});
  std::ifstream f(dir + "/" + name + ".bin", std::ios::binary | std::ios::ate);
  if (!f || static_cast<size_t>(f.tellg()) != n * sizeof(T))
    die(name + ".bin: missing or not " + std::to_string(n * sizeof(T)) + " bytes");
  f.seekg(0);
  f.read(reinterpret_cast<char*>(buf.get()), n * sizeof(T));
  return buf;
}

template <class T>
void save(const std::string& dir, const std::string& name, const Buffer<T>& buf) {
  std::ofstream f(dir + "/" + name + ".bin", std::ios::binary);
  f.write(reinterpret_cast<const char*>(buf.data.data()), buf.data.size() * sizeof(T));
  if (!f) die("cannot write " + name + ".bin");
}

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  const std::string detail = megarl::take_launch_error_detail();
  die(std::string(what) + " returned cudaError " + std::to_string(err) + (detail.empty() ? "" : ": " + detail));
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr uint16_t kNaNBf16 = 0x7fc0;

struct Logits {  // the operands shared by forward and backward
  int T, H, rows, valid_v;
  int64_t vocab_start;
  float inv_tau;
};

Logits parse_logits(char** argv) {
  return {std::atoi(argv[0]), std::atoi(argv[1]), std::atoi(argv[2]), std::atoi(argv[3]),
          std::atoll(argv[4]), std::strtof(argv[5], nullptr)};
}

// The CTA order's token blocks per group: $CTA_GROUP, else the launchers' default.
int cta_group() {
  const char* env = std::getenv("CTA_GROUP");
  return env != nullptr ? std::atoi(env) : megarl::kDefaultCtaGroup;
}

// Which mainloop's launchers to call; sm90 also makes the emulated device a 9.0 one.
bool use_sm90(const std::string& mainloop) {
  if (mainloop == "sm80") return false;
  if (mainloop != "sm90") die("MAINLOOP must be sm80 or sm90, not " + mainloop);
  cuda_emu::set_compute_capability(9, 0);
  if (!megarl::sm90_mainloop_available()) die("sm90_mainloop_available() is false");
  return true;
}

void forward(const std::string& mainloop, const std::string& dir, char** argv, bool store) {
  const bool sm90 = use_sm90(mainloop);
  const Logits a = parse_logits(argv);
  const int splits = std::atoi(argv[6]);
  const int ld = store ? std::atoi(argv[7]) : 0;
  auto hidden = load<uint16_t>(dir, "hidden", size_t(a.T) * a.H);
  auto weight = load<uint16_t>(dir, "weight", size_t(a.rows) * a.H);
  auto labels = load<int64_t>(dir, "labels", a.T);
  Buffer<float> part(size_t(3) * splits * a.T, kNaN);
  Buffer<float> label_logit(a.T, 0.f);
  Buffer<float> logits(size_t(a.T) * ld, kNaN);
  const auto launch = sm90 ? megarl::launch_logprob_forward_sm90 : megarl::launch_logprob_forward;
  check(launch(hidden.get(), weight.get(), labels.get(), a.T, a.H, a.valid_v, a.vocab_start,
               a.inv_tau, splits, part.get(), label_logit.get(), store ? logits.get() : nullptr, ld,
               cta_group(), nullptr),
        "launch_logprob_forward");
  save(dir, "part", part);
  save(dir, "label_logit", label_logit);
  if (store) save(dir, "logits", logits);
}

// theta [T] from DIR where the optional `truncated` argument is 1, else an empty buffer (the
// launch gets a null threshold).
Buffer<float> load_theta(const std::string& dir, const char* truncated, int T) {
  if (truncated == nullptr || std::atoi(truncated) == 0) return Buffer<float>(0, 0.f);
  return load<float>(dir, "theta", T);
}

void softmax_grad(const std::string& dir, char** argv, const char* truncated) {
  const int T = std::atoi(argv[0]), valid_v = std::atoi(argv[1]);
  const int64_t vocab_start = std::atoll(argv[2]);
  const float inv_tau = std::strtof(argv[3], nullptr);
  const int ld_logits = std::atoi(argv[4]), ld_dz = std::atoi(argv[5]);
  auto logits = load<float>(dir, "logits", size_t(T) * ld_logits);
  auto labels = load<int64_t>(dir, "labels", T);
  auto lse = load<float>(dir, "lse", T);
  auto mean_z = load<float>(dir, "mean_z", T);
  auto g_lp = load<float>(dir, "g_lp", T);
  auto g_ent = load<float>(dir, "g_ent", T);
  auto theta = load_theta(dir, truncated, T);
  Buffer<uint16_t> dz(size_t(T) * ld_dz, kNaNBf16);
  check(megarl::launch_softmax_grad_stored(
            logits.get(), ld_logits, labels.get(), T, valid_v, vocab_start, inv_tau, lse.get(),
            mean_z.get(), g_lp.get(), g_ent.get(), theta.data.empty() ? nullptr : theta.get(),
            dz.get(), ld_dz, nullptr),
        "launch_softmax_grad_stored");
  save(dir, "dz", dz);
}

void backward(const std::string& mainloop, const std::string& dir, char** argv,
              const char* truncated) {
  const bool sm90 = use_sm90(mainloop);
  const Logits a = parse_logits(argv);
  const int col_begin = std::atoi(argv[6]), col_count = std::atoi(argv[7]), ld = std::atoi(argv[8]);
  auto hidden = load<uint16_t>(dir, "hidden", size_t(a.T) * a.H);
  auto weight = load<uint16_t>(dir, "weight", size_t(a.rows) * a.H);
  auto labels = load<int64_t>(dir, "labels", a.T);
  auto lse = load<float>(dir, "lse", a.T);
  auto mean_z = load<float>(dir, "mean_z", a.T);
  auto g_lp = load<float>(dir, "g_lp", a.T);
  auto g_ent = load<float>(dir, "g_ent", a.T);
  auto theta = load_theta(dir, truncated, a.T);
  Buffer<uint16_t> dz(size_t(a.T) * ld, kNaNBf16);
  const auto launch =
      sm90 ? megarl::launch_logprob_backward_dz_sm90 : megarl::launch_logprob_backward_dz;
  check(launch(hidden.get(), weight.get(), labels.get(), a.T, a.H, a.valid_v, a.vocab_start,
               a.inv_tau, lse.get(), mean_z.get(), g_lp.get(), g_ent.get(),
               theta.data.empty() ? nullptr : theta.get(), col_begin, col_count, dz.get(), ld,
               cta_group(), nullptr),
        "launch_logprob_backward_dz");
  save(dir, "dz", dz);
}

void ppo(const std::string& dir, char** argv) {
  const int T = std::atoi(argv[0]);
  const float eps_low = std::strtof(argv[1], nullptr), eps_high = std::strtof(argv[2], nullptr);
  const float dual_clip = std::strtof(argv[3], nullptr), behav_cap = std::strtof(argv[4], nullptr);
  const bool has_prox = std::atoi(argv[5]) != 0;
  auto logp = load<float>(dir, "logp", T);
  auto old_logp = load<float>(dir, "old_logp", T);
  auto adv = load<float>(dir, "adv", T);
  auto mask = load<uint8_t>(dir, "mask", T);  // bool: one byte, 0 or 1
  Buffer<float> prox = has_prox ? load<float>(dir, "prox_logp", T) : Buffer<float>(0, 0.f);
  Buffer<float> loss_tok(T, kNaN), grad_tok(T, kNaN);
  Buffer<float> stats(megarl::kNumPPOStats, 0.f);
  stats.data[megarl::kStatRatioMin] = INFINITY;
  const auto* mask_ptr = reinterpret_cast<const bool*>(mask.get());
  check(megarl::launch_ppo_loss(logp.get(), old_logp.get(), has_prox ? prox.get() : nullptr,
                                adv.get(), mask_ptr, T, eps_low, eps_high, dual_clip, behav_cap,
                                loss_tok.get(), grad_tok.get(), stats.get(), nullptr),
        "launch_ppo_loss");
  save(dir, "loss_tok", loss_tok);
  save(dir, "grad_tok", grad_tok);
  save(dir, "stats", stats);
}

void tma_refused() {
  use_sm90("sm90");
  const int T = 5, H = 64, rows = 8;
  Buffer<uint16_t> hidden(size_t(T) * H + 8, 0), weight(size_t(rows) * H, 0);
  Buffer<int64_t> labels(T, 0);
  Buffer<float> part(3 * T, kNaN), label_logit(T, 0.f);
  check(megarl::launch_logprob_forward_sm90(hidden.get() + 1, weight.get(), labels.get(), T, H, rows, 0,
                                            1.f, 1, part.get(), label_logit.get(), nullptr, 0,
                                            cta_group(), nullptr),
        "launch_logprob_forward_sm90");
  std::printf("tma_refused: the launch succeeded\n");
}

// An mbarrier expecting two arrivals gets one, so its phase 0 never completes; one thread of one
// CTA waits for it, every other thread exits.
__global__ void mbar_hang_kernel(int block_x, int block_y, int waiter) {
  MEGARL_DYNAMIC_SMEM(smem);
  auto* bar = reinterpret_cast<uint64_t*>(smem);
  if (threadIdx.x == 0) {
    megarl::sm90::mbar_init(bar, 2);
    megarl::sm90::fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) megarl::sm90::mbar_arrive(bar);
  if (static_cast<int>(blockIdx.x) == block_x && static_cast<int>(blockIdx.y) == block_y &&
      static_cast<int>(threadIdx.x) == waiter)
    megarl::sm90::mbar_wait(bar, 0);
}

void mbar_hang(char** argv) {
  cuda_emu::set_compute_capability(9, 0);
  MEGARL_LAUNCH(mbar_hang_kernel, dim3(3, 2), dim3(64), 16, nullptr)(
      std::atoi(argv[0]), std::atoi(argv[1]), std::atoi(argv[2]));
  std::printf("mbar_hang: the kernel returned\n");
}

__global__ void cta_order_kernel(int rows) {
  if (threadIdx.x == 0 && megarl::grouped_row() < rows)
    std::printf("%d %d\n", megarl::grouped_col(), megarl::grouped_row());
}

void cta_order(char** argv) {
  const int cols = std::atoi(argv[0]), rows = std::atoi(argv[1]), group = std::atoi(argv[2]);
  if (cols < 1 || rows < 1 || group < 1) die("cta_order: COLS, ROWS and GROUP must be >= 1");
  MEGARL_LAUNCH(cta_order_kernel, megarl::grouped_grid(cols, rows, group), dim3(32), 0, nullptr)(rows);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string op = argc > 1 ? argv[1] : "";
  if (op == "forward" && (argc == 11 || argc == 12)) {
    forward(argv[2], argv[3], argv + 4, argc == 12);
  } else if (op == "softmax_grad" && (argc == 9 || argc == 10)) {
    softmax_grad(argv[2], argv + 3, argc == 10 ? argv[9] : nullptr);
  } else if (op == "backward" && (argc == 13 || argc == 14)) {
    backward(argv[2], argv[3], argv + 4, argc == 14 ? argv[13] : nullptr);
  } else if (op == "ppo" && argc == 9) {
    ppo(argv[2], argv + 3);
  } else if (op == "tma_refused" && argc == 2) {
    tma_refused();
  } else if (op == "mbar_hang" && argc == 5) {
    mbar_hang(argv + 2);
  } else if (op == "cta_order" && argc == 5) {
    cta_order(argv + 2);
  } else {
    die("usage: see the comment at the top of run_kernels.cpp");
  }
  return 0;
}
