// Host entry points of the fused kernels: raw pointers and a stream, no torch types,
// so that the .cu files compile with the CUDA toolkit alone and bindings.cpp holds
// everything that needs torch.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

namespace megarl {

// Tile sizes shared by the host (grid and partial-buffer sizes) and the kernels.
constexpr int kTileTokens = 128;  // BM: token rows per CTA tile
constexpr int kTileVocab = 128;   // BN: vocabulary rows per CTA tile
constexpr int kTileVocabSm90 = 256;  // BN of the sm_90a mainloop
// The CTA order of the forward and backward launches (cta_order.cuh): token blocks per group
// (`cta_group` of the launchers; 1 is the column-fastest order of the first kernels). The default
// comes from benchmarks/cta_order_model.py, a model of L2 reuse, until a GPU sweep
// (benchmarks/profile_forward.py --sweep) measures it; megarl's drivers pass their own
// (megarl/kernels/_cuda.py cta_group: fewer blocks where the hidden size is large).
constexpr int kDefaultCtaGroup = 32;

// Forward of the fused logprob + entropy: per (token block, vocab split) CTA, an online
// logsumexp over the split's vocab tiles. Writes per-split partial statistics of
// z = hidden . weight^T * inv_tau, over the first `valid_v` rows of the shard:
//   part[0][split][t] = max_v z, part[1] = sum_v exp(z - max), part[2] = sum_v exp(z - max) * (z - max)
// and label_logit[t] = z[t, labels[t] - vocab_start] where that row is in this shard
// (label_logit must be zeroed by the caller; exactly one CTA writes each owned token).
// hidden [T,H] bf16, weight [V,H] bf16 (row-major, contiguous), labels [T] int64,
// part [3, num_splits, T] fp32. H must be a multiple of 8 (16-byte cp.async rows). cta_group >= 1:
// the CTA order (cta_order.cuh), which changes the speed and never the results.
// The training path's variant: where `logits` is not null, the raw logits x = hidden . weight^T
// (before the temperature) of the valid rows are also written, fp32, to logits[t * ld + v]
// for v < valid_v (columns past valid_v untouched; ld even and >= valid_v, logits 8-byte aligned).
cudaError_t launch_logprob_forward(const void* hidden, const void* weight, const int64_t* labels,
                                   int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                                   int num_splits, float* part, float* label_logit, float* logits,
                                   int ld, int cta_group, cudaStream_t stream);

// Backward: recompute logits for vocab rows [col_begin, col_begin + col_count) of the shard and
// write dL/dx = inv_tau * dL/dz as bf16 into dz[t * ld + (v - col_begin)], where
//   dL/dz_v = g_lp * (1[v == label] - p_v) - g_ent * p_v * (z_v - mean_z),  p_v = exp(z_v - lse).
// lse, mean_z, g_lp, g_ent: [T] fp32 (g_lp already zero for ignored labels). Rows >= valid_v get 0.
// theta: null, or [T] fp32 truncation thresholds in units of z (truncation replay): p_v = 0 where
// z_v < theta[t], and lse, mean_z are then those of the softmax over {v : z_v >= theta[t]} (the
// label's one-hot term stays wherever it lies; -inf keeps every token of that row).
// col_begin must be even; ld must be even; cta_group as for the forward.
cudaError_t launch_logprob_backward_dz(const void* hidden, const void* weight, const int64_t* labels,
                                       int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                                       const float* lse, const float* mean_z, const float* g_lp,
                                       const float* g_ent, const float* theta, int col_begin,
                                       int col_count, void* dz, int ld, int cta_group,
                                       cudaStream_t stream);

// The training path's softmax gradient from stored logits (softmax_grad.cu): for the raw logits
// x [T, ld_logits] fp32 that the storing forward wrote, dz[t * ld_dz + v] = bf16 of the same
// dL/dx as launch_logprob_backward_dz (theta likewise), for v < valid_v (columns past valid_v
// untouched). ld_logits and ld_dz even and >= valid_v.
cudaError_t launch_softmax_grad_stored(const float* logits, int ld_logits, const int64_t* labels,
                                       int T, int valid_v, int64_t vocab_start, float inv_tau,
                                       const float* lse, const float* mean_z, const float* g_lp,
                                       const float* g_ent, const float* theta, void* dz, int ld_dz,
                                       cudaStream_t stream);

// The same two kernels on Hopper's TMA + wgmma mainloop (fused_logprob_sm90.cu): identical
// contracts, 128 x 256 logit tiles. Launch them only where sm90_mainloop_available() (a device
// of compute capability 9.0 and sm_90a code in this binary); they also need valid_v > 0 and
// 16-byte aligned hidden and weight.
struct Sm90Status {
  bool available = false;
  bool definite = false;  // false: the probe itself failed (an allocation, a launch); ask again
  std::string reason;     // why not, when not available
};
Sm90Status sm90_mainloop_status();
bool sm90_mainloop_available();  // sm90_mainloop_status().available
// What a launcher's cudaError_t cannot say about its failure on this thread (e.g. the driver's
// code and the parameters of a tensor map it refused), or ""; reading clears it.
std::string take_launch_error_detail();
cudaError_t launch_logprob_forward_sm90(const void* hidden, const void* weight, const int64_t* labels,
                                        int T, int H, int valid_v, int64_t vocab_start, float inv_tau,
                                        int num_splits, float* part, float* label_logit,
                                        float* logits, int ld, int cta_group, cudaStream_t stream);
cudaError_t launch_logprob_backward_dz_sm90(const void* hidden, const void* weight,
                                            const int64_t* labels, int T, int H, int valid_v,
                                            int64_t vocab_start, float inv_tau, const float* lse,
                                            const float* mean_z, const float* g_lp, const float* g_ent,
                                            const float* theta, int col_begin, int col_count, void* dz,
                                            int ld, int cta_group, cudaStream_t stream);

// Indices into the raw statistics vector written by launch_ppo_loss.
enum PPOStat : int {
  kStatCount = 0,        // masked tokens
  kStatClipped = 1,      // masked tokens where the clipped surrogate is active
  kStatDualClipped = 2,  // masked tokens where the dual clip is active
  kStatRatioSum = 3,     // sum of the importance ratio exp(logp - prox)
  kStatKLSum = 4,        // sum of logp - prox
  kStatBehavSum = 5,     // sum of the behaviour weight after the cap (1 without prox)
  kStatBehavCapped = 6,  // masked tokens dropped by the behaviour-weight cap
  kStatRatioMax = 7,     // max ratio (float bits, atomicMax on int: ratios are >= 0)
  kStatRatioMin = 8,     // min ratio (caller initialises to +inf)
  kNumPPOStats = 9,
};

// Elementwise PPO/GRPO clipped surrogate over T tokens (fp32 in, bool mask).
// prox may be null (then ratio = exp(logp - old) and no behaviour weight).
// dual_clip <= 0 disables the dual clip, behav_cap <= 0 disables the cap.
// Writes loss_tok[t] = mask * w * pg, grad_tok[t] = d loss_tok / d logp, and accumulates stats.
cudaError_t launch_ppo_loss(const float* logp, const float* old_logp, const float* prox_logp,
                            const float* adv, const bool* mask, int64_t T, float eps_low,
                            float eps_high, float dual_clip, float behav_cap, float* loss_tok,
                            float* grad_tok, float* stats, cudaStream_t stream);

}  // namespace megarl
