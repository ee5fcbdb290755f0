// Torch bindings of the fused kernels (module megarl._C, or megarl_C when JIT-built).
// Shape and dtype checks live here; the Python layer (megarl/kernels) decides when to call.
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "kernels.h"

namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  const std::string detail = megarl::take_launch_error_detail();
  TORCH_CHECK(false, what, " failed: ", cudaGetErrorString(err), detail.empty() ? "" : ": ", detail);
}

void check_operands(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels) {
  TORCH_CHECK(hidden.is_cuda() && weight.is_cuda() && labels.is_cuda(), "tensors must be on CUDA");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2, "hidden [T,H] and weight [V,H] must be 2-D, got ",
              hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(hidden.size(1) == weight.size(1), "hidden size mismatch: hidden ", hidden.sizes(),
              " weight ", weight.sizes());
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "hidden and weight must be bfloat16, got ", hidden.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(hidden.is_contiguous() && weight.is_contiguous(), "hidden and weight must be contiguous");
  TORCH_CHECK(hidden.size(1) % 8 == 0, "hidden size must be a multiple of 8, got ", hidden.size(1));
  // both mainloops read 16-byte rows (cp.async on sm_80, TMA on sm_90a)
  TORCH_CHECK(reinterpret_cast<uintptr_t>(hidden.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              "hidden and weight must start on a 16-byte boundary");
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.is_contiguous() && labels.dim() == 1 &&
                  labels.size(0) == hidden.size(0),
              "labels must be contiguous int64 [T], got ", labels.scalar_type(), " ", labels.sizes());
}

void check_vec(const at::Tensor& x, int64_t T, const char* name) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1 &&
                  x.size(0) == T,
              name, " must be contiguous float32 [", T, "], got ", x.scalar_type(), " ", x.sizes());
}

// Whether the wgmma mainloop can run here; a `wgmma` request it cannot serve is an error.
bool use_wgmma(bool wgmma, int64_t valid_v) {
  TORCH_CHECK(!wgmma || megarl::sm90_mainloop_available(),
              "wgmma mainloop requested, but this device is not sm_90 or the extension was built "
              "without -gencode=arch=compute_90a,code=sm_90a");
  return wgmma && valid_v > 0;  // an all-padding shard has nothing to multiply
}

// A [T, >=valid_v] fp32 (kind "logits", read or written as column pairs) or bf16 ("dz") buffer
// with unit column stride and an even row stride.
void check_chunk(const at::Tensor& x, at::ScalarType dtype, int64_t T, int64_t valid_v, const char* name) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == dtype && x.dim() == 2 && x.size(0) == T &&
                  x.size(1) >= valid_v && x.stride(1) == 1 && x.stride(0) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % (2 * x.element_size()) == 0,
              name, " must be ", dtype, " [", T, ", >=", valid_v,
              "] with unit column stride, an even row stride and pair-aligned storage, got ",
              x.scalar_type(), " ", x.sizes(), " strides ", x.strides());
}

// Returns (part [3, num_splits, T] fp32, label_logit [T] fp32); see launch_logprob_forward.
// With `logits` (fp32 [T, >=valid_v]) the training path's variant also stores the raw logits there.
std::vector<at::Tensor> logprob_forward(const at::Tensor& hidden, const at::Tensor& weight,
                                        const at::Tensor& labels, int64_t valid_v,
                                        int64_t vocab_start, double inv_tau, int64_t num_splits,
                                        bool wgmma, const std::optional<at::Tensor>& logits,
                                        int64_t cta_group) {
  check_operands(hidden, weight, labels);
  TORCH_CHECK(valid_v >= 0 && valid_v <= weight.size(0), "valid_v out of range: ", valid_v);
  TORCH_CHECK(num_splits >= 1, "num_splits must be >= 1, got ", num_splits);
  TORCH_CHECK(cta_group >= 1, "cta_group must be >= 1, got ", cta_group);
  if (logits) check_chunk(*logits, at::kFloat, hidden.size(0), valid_v, "logits");
  const c10::cuda::CUDAGuard guard(hidden.device());
  const int64_t T = hidden.size(0);
  auto opts = hidden.options().dtype(at::kFloat);
  auto part = at::empty({3, num_splits, T}, opts);
  auto label_logit = at::zeros({T}, opts);
  const auto launch = use_wgmma(wgmma, valid_v) ? megarl::launch_logprob_forward_sm90
                                                 : megarl::launch_logprob_forward;
  check_cuda(launch(
                 hidden.data_ptr(), weight.data_ptr(), labels.data_ptr<int64_t>(),
                 static_cast<int>(T), static_cast<int>(hidden.size(1)), static_cast<int>(valid_v),
                 vocab_start, static_cast<float>(inv_tau), static_cast<int>(num_splits),
                 part.data_ptr<float>(), label_logit.data_ptr<float>(),
                 logits ? logits->data_ptr<float>() : nullptr,
                 logits ? static_cast<int>(logits->stride(0)) : 0, static_cast<int>(cta_group),
                 c10::cuda::getCurrentCUDAStream()),
             "logprob_forward");
  return {part, label_logit};
}

// The optional truncation thresholds [T] fp32 (units of z) as the launchers take them: null for none.
const float* theta_ptr(const std::optional<at::Tensor>& theta, int64_t T) {
  if (!theta) return nullptr;
  check_vec(*theta, T, "theta");
  return theta->data_ptr<float>();
}

// Writes the softmax gradient of the stored raw logits [T, >=valid_v] into dz[:, :valid_v] (bf16);
// see launch_softmax_grad_stored. theta: the per-token truncation thresholds, or None.
void softmax_grad_stored(const at::Tensor& logits, const at::Tensor& labels, int64_t valid_v,
                         int64_t vocab_start, double inv_tau, const at::Tensor& lse,
                         const at::Tensor& mean_z, const at::Tensor& g_lp, const at::Tensor& g_ent,
                         const at::Tensor& dz, const std::optional<at::Tensor>& theta) {
  const int64_t T = logits.size(0);
  check_chunk(logits, at::kFloat, T, valid_v, "logits");
  check_chunk(dz, at::kBFloat16, T, valid_v, "dz");
  TORCH_CHECK(labels.is_cuda() && labels.scalar_type() == at::kLong && labels.is_contiguous() &&
                  labels.dim() == 1 && labels.size(0) == T,
              "labels must be contiguous int64 [", T, "], got ", labels.scalar_type(), " ", labels.sizes());
  check_vec(lse, T, "lse");
  check_vec(mean_z, T, "mean_z");
  check_vec(g_lp, T, "g_lp");
  check_vec(g_ent, T, "g_ent");
  const float* theta_data = theta_ptr(theta, T);
  const c10::cuda::CUDAGuard guard(logits.device());
  check_cuda(megarl::launch_softmax_grad_stored(
                 logits.data_ptr<float>(), static_cast<int>(logits.stride(0)),
                 labels.data_ptr<int64_t>(), static_cast<int>(T), static_cast<int>(valid_v),
                 vocab_start, static_cast<float>(inv_tau), lse.data_ptr<float>(),
                 mean_z.data_ptr<float>(), g_lp.data_ptr<float>(), g_ent.data_ptr<float>(),
                 theta_data, dz.data_ptr(), static_cast<int>(dz.stride(0)),
                 c10::cuda::getCurrentCUDAStream()),
             "softmax_grad_stored");
}

// Writes dL/dx for shard rows [col_begin, col_begin + col_count) into dz[:, :col_count];
// theta: the per-token truncation thresholds, or None (see launch_logprob_backward_dz).
void logprob_backward_dz(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                         int64_t valid_v, int64_t vocab_start, double inv_tau, const at::Tensor& lse,
                         const at::Tensor& mean_z, const at::Tensor& g_lp, const at::Tensor& g_ent,
                         int64_t col_begin, int64_t col_count, const at::Tensor& dz, bool wgmma,
                         const std::optional<at::Tensor>& theta, int64_t cta_group) {
  check_operands(hidden, weight, labels);
  const int64_t T = hidden.size(0);
  check_vec(lse, T, "lse");
  check_vec(mean_z, T, "mean_z");
  check_vec(g_lp, T, "g_lp");
  check_vec(g_ent, T, "g_ent");
  TORCH_CHECK(dz.is_cuda() && dz.scalar_type() == at::kBFloat16 && dz.dim() == 2 &&
                  dz.size(0) == T && dz.stride(1) == 1 && dz.stride(0) % 2 == 0 &&
                  dz.size(1) >= col_count,
              "dz must be bfloat16 [T, >=col_count] with unit column stride and even row stride, got ",
              dz.sizes(), " strides ", dz.strides());
  TORCH_CHECK(col_begin % 2 == 0, "col_begin must be even, got ", col_begin);
  TORCH_CHECK(col_begin >= 0 && col_count >= 0 && col_begin + col_count <= weight.size(0),
              "column range out of bounds: ", col_begin, "+", col_count);
  TORCH_CHECK(cta_group >= 1, "cta_group must be >= 1, got ", cta_group);
  const float* theta_data = theta_ptr(theta, T);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const auto launch = use_wgmma(wgmma, valid_v) ? megarl::launch_logprob_backward_dz_sm90
                                                 : megarl::launch_logprob_backward_dz;
  check_cuda(launch(
                 hidden.data_ptr(), weight.data_ptr(), labels.data_ptr<int64_t>(),
                 static_cast<int>(T), static_cast<int>(hidden.size(1)), static_cast<int>(valid_v),
                 vocab_start, static_cast<float>(inv_tau), lse.data_ptr<float>(),
                 mean_z.data_ptr<float>(), g_lp.data_ptr<float>(), g_ent.data_ptr<float>(),
                 theta_data, static_cast<int>(col_begin), static_cast<int>(col_count), dz.data_ptr(),
                 static_cast<int>(dz.stride(0)), static_cast<int>(cta_group),
                 c10::cuda::getCurrentCUDAStream()),
             "logprob_backward_dz");
}

// Returns (loss_tok [T], grad_tok [T], raw stats [kNumPPOStats]); see launch_ppo_loss.
std::vector<at::Tensor> ppo_loss(const at::Tensor& logp, const at::Tensor& old_logp,
                                 const std::optional<at::Tensor>& prox_logp, const at::Tensor& adv,
                                 const at::Tensor& mask, double eps_low, double eps_high,
                                 double dual_clip, double behav_cap) {
  const int64_t T = logp.numel();
  check_vec(logp, T, "logprobs");
  check_vec(old_logp, T, "old_logprobs");
  check_vec(adv, T, "advantages");
  if (prox_logp) check_vec(*prox_logp, T, "prox_logprobs");
  TORCH_CHECK(mask.is_cuda() && mask.scalar_type() == at::kBool && mask.is_contiguous() &&
                  mask.numel() == T,
              "loss_mask must be contiguous bool [", T, "], got ", mask.scalar_type(), " ", mask.sizes());
  const c10::cuda::CUDAGuard guard(logp.device());
  auto loss_tok = at::empty_like(logp);
  auto grad_tok = at::empty_like(logp);
  auto stats = at::zeros({megarl::kNumPPOStats}, logp.options());
  stats.narrow(0, megarl::kStatRatioMin, 1).fill_(std::numeric_limits<float>::infinity());
  check_cuda(megarl::launch_ppo_loss(
                 logp.data_ptr<float>(), old_logp.data_ptr<float>(),
                 prox_logp ? prox_logp->data_ptr<float>() : nullptr, adv.data_ptr<float>(),
                 mask.data_ptr<bool>(), T, static_cast<float>(eps_low), static_cast<float>(eps_high),
                 static_cast<float>(dual_clip), static_cast<float>(behav_cap),
                 loss_tok.data_ptr<float>(), grad_tok.data_ptr<float>(), stats.data_ptr<float>(),
                 c10::cuda::getCurrentCUDAStream()),
             "ppo_loss");
  return {loss_tok, grad_tok, stats};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megarl fused kernels: logprob + entropy over a vocab-parallel LM head, PPO loss";
  m.def("logprob_forward", &logprob_forward, "fused logprob/entropy forward partials",
        py::arg("hidden"), py::arg("weight"), py::arg("labels"), py::arg("valid_v"),
        py::arg("vocab_start"), py::arg("inv_tau"), py::arg("num_splits"), py::arg("wgmma"),
        py::arg("logits") = py::none(), py::arg("cta_group") = megarl::kDefaultCtaGroup);
  m.def("softmax_grad_stored", &softmax_grad_stored,
        "the training path's softmax gradient from the stored logits of a token chunk",
        py::arg("logits"), py::arg("labels"), py::arg("valid_v"), py::arg("vocab_start"),
        py::arg("inv_tau"), py::arg("lse"), py::arg("mean_z"), py::arg("g_lp"), py::arg("g_ent"),
        py::arg("dz"), py::arg("theta") = py::none());
  m.def("logprob_backward_dz", &logprob_backward_dz, "recomputed-logit softmax gradient chunk",
        py::arg("hidden"), py::arg("weight"), py::arg("labels"), py::arg("valid_v"),
        py::arg("vocab_start"), py::arg("inv_tau"), py::arg("lse"), py::arg("mean_z"),
        py::arg("g_lp"), py::arg("g_ent"), py::arg("col_begin"), py::arg("col_count"), py::arg("dz"),
        py::arg("wgmma"), py::arg("theta") = py::none(), py::arg("cta_group") = megarl::kDefaultCtaGroup);
  m.def("sm90_mainloop_available", &megarl::sm90_mainloop_available,
        "whether the TMA + wgmma mainloop runs on the current device");
  m.def(
      "sm90_mainloop_status",
      [] {
        const megarl::Sm90Status s = megarl::sm90_mainloop_status();
        return std::make_tuple(s.available, s.definite, s.reason);
      },
      "(available, definite, reason) of the TMA + wgmma mainloop on the current device; "
      "definite is false when the probe itself failed and may succeed later");
  m.def("ppo_loss", &ppo_loss, "PPO clipped surrogate: per-token loss, gradient, stats");
  m.attr("TILE_TOKENS") = megarl::kTileTokens;
  m.attr("TILE_VOCAB") = megarl::kTileVocab;
  m.attr("TILE_VOCAB_SM90") = megarl::kTileVocabSm90;
  m.attr("DEFAULT_CTA_GROUP") = megarl::kDefaultCtaGroup;
  m.attr("NUM_PPO_STATS") = static_cast<int>(megarl::kNumPPOStats);
}
