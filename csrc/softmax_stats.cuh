// The per-token arithmetic shared by every mainloop of the fused logprob kernels: the running
// softmax statistics of the forward and the softmax gradient of the backward.
//
// Per token the forward keeps three running numbers over the vocab it has seen (in units of
// z = logit / temperature): m = max z, s = sum exp(z - m), u = sum exp(z - m) (z - m). Then
// lse = m + log s and entropy = log s - u / s (shifted so that a peaked softmax keeps its
// precision). Two such triples merge exactly, which is what the lane shuffles, the per-split
// partials and the cross-TP collectives all do.
#pragma once

#include <cmath>
#include <cstdint>

namespace megarl {

struct Stats {
  float m;  // running max of z
  float s;  // sum exp(z - m)
  float u;  // sum exp(z - m) (z - m)
};

__device__ __forceinline__ Stats empty_stats() { return {-INFINITY, 0.f, 0.f}; }

// Exact merge of two triples; an empty triple (m = -inf) contributes nothing, and the
// (-inf) * 0 products that a naive rescale would produce are never formed.
__device__ __forceinline__ Stats merge(Stats a, Stats b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return a;
  Stats r{m, 0.f, 0.f};
  if (a.m != -INFINITY) {
    const float da = a.m - m;
    const float sa = __expf(da);
    r.s += sa * a.s;
    r.u += sa * (a.u + da * a.s);
  }
  if (b.m != -INFINITY) {
    const float db = b.m - m;
    const float sb = __expf(db);
    r.s += sb * b.s;
    r.u += sb * (b.u + db * b.s);
  }
  return r;
}

__device__ __forceinline__ Stats shfl_xor(Stats x, int mask) {
  return {__shfl_xor_sync(0xffffffffu, x.m, mask), __shfl_xor_sync(0xffffffffu, x.s, mask),
          __shfl_xor_sync(0xffffffffu, x.u, mask)};
}

// Merge the triples of the 4 lanes of a quad (lanes 4q..4q+3), which hold the same token rows.
__device__ __forceinline__ Stats quad_merge(Stats x) {
  x = merge(x, shfl_xor(x, 1));
  return merge(x, shfl_xor(x, 2));
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The fast path of fold_row: every column valid and none of them the label, so no per-column
// test. z - m is formed in log2 units by one FMA per logit (temperature and log2(e) folded into
// the scale, the max into the offset) and fed to exp2 (ex2.approx under --use_fast_math); four
// independent partial sums keep the exp latency off one dependency chain.
template <int N, class Value>
__device__ __forceinline__ void fold_row_full(Stats& st, Value value, float inv_tau) {
  static_assert(N % 4 == 0, "the fast path folds 4 columns at a time");
  float mx[4] = {value(0), value(1), value(2), value(3)};
#pragma unroll
  for (int i = 4; i < N; i += 4)
#pragma unroll
    for (int j = 0; j < 4; ++j) mx[j] = fmaxf(mx[j], value(i + j));
  // inv_tau > 0: the max of the raw logits scales to the max of z
  const float m = fmaxf(st.m, fmaxf(fmaxf(mx[0], mx[1]), fmaxf(mx[2], mx[3])) * inv_tau);
  const float scale = inv_tau * kLog2e;
  const float offset = -m * kLog2e;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  float u[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < N; i += 4)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float d2 = fmaf(value(i + j), scale, offset);  // (z - m) * log2(e)
      const float e = exp2f(d2);
      s[j] += e;
      u[j] = fmaf(e, d2, u[j]);
    }
  const Stats t{m, (s[0] + s[1]) + (s[2] + s[3]), ((u[0] + u[1]) + (u[2] + u[3])) * kLn2};
  st = merge(st, t);
}

// Fold N logits of one token row into its running triple. value(i) is the raw logit (before
// temperature) and column(i) its row of the vocab shard, all within the tile's columns
// [tile_begin, tile_begin + tile_width); columns >= valid_v are padding and skipped. The label
// logit (in units of z) is stored where column(i) == label. A tile wholly valid that does not
// hold the label column takes fold_row_full; the others (the label's tile, the shard's last
// partial tile) test every column.
template <int N, class Value, class Column>
__device__ __forceinline__ void fold_row(Stats& st, Value value, Column column, int valid_v,
                                         float inv_tau, int label, float* label_logit,
                                         int tile_begin, int tile_width) {
  const int tile_end = tile_begin + tile_width;
  if (tile_end <= valid_v && (label < tile_begin || label >= tile_end)) {
    fold_row_full<N>(st, value, inv_tau);
    return;
  }
  float tmax = -INFINITY;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (column(i) < valid_v) tmax = fmaxf(tmax, value(i) * inv_tau);
  if (tmax == -INFINITY) return;  // no valid column of this row here
  Stats t{fmaxf(st.m, tmax), 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int v = column(i);
    if (v < valid_v) {
      const float z = value(i) * inv_tau;
      const float d = z - t.m;
      const float e = __expf(d);
      t.s += e;
      t.u += e * d;
      if (v == label && label_logit != nullptr) *label_logit = z;
    }
  }
  st = merge(st, t);
}

// The per-token inputs of the backward's softmax-gradient epilogue.
struct RowGrad {
  float lse;     // logsumexp of z (over the kept tokens z >= theta under truncation)
  float mean_z;  // E_p[z] (likewise)
  float g_lp;    // upstream gradient of the logprob (0 for ignored labels)
  float g_ent;   // upstream gradient of the entropy
  int64_t label; // label as a row of this shard (may lie outside it)
  float theta;   // truncation threshold in units of z (read by softmax_grad<true> only)
};

// The row's truncation threshold: theta[row] where the launch was given one, else -inf (kept
// everywhere; softmax_grad<false> never reads it).
__device__ __forceinline__ float row_theta(const float* theta, int row) {
  return theta != nullptr ? theta[row] : -INFINITY;
}

// dL/dx at one logit x = z * tau, for shard row v:
//   inv_tau * (g_lp (1[v == label] - p) - g_ent p (z - E[z])),  p = exp(z - lse); 0 for padding.
// kTruncated (truncation replay, megarl/kernels/truncation.py): the softmax is over the kept
// tokens z >= r.theta only, so p = 0 below the threshold (in both terms; lse and E[z] are then
// the truncated distribution's); the label keeps its one-hot term wherever it lies. The kernels
// pick the instantiation once per row from whether the launch has a threshold, so the
// untruncated arithmetic is exactly the one without it.
template <bool kTruncated = false>
__device__ __forceinline__ float softmax_grad(float x, int v, const RowGrad& r, int valid_v,
                                              float inv_tau) {
  if (v >= valid_v) return 0.f;
  const float z = x * inv_tau;
  float p = __expf(z - r.lse);
  if (kTruncated && z < r.theta) p = 0.f;
  const float onehot = (v == r.label) ? 1.f : 0.f;
  return (r.g_lp * (onehot - p) - r.g_ent * p * (z - r.mean_z)) * inv_tau;
}

// body(Truncated<true>{}) where the launch has a truncation threshold, body(Truncated<false>{})
// where it has none (theta == nullptr): one uniform branch per row, which picks the
// instantiation of softmax_grad that the row's columns run (decltype(tag)::value).
template <bool B>
struct Truncated {
  static constexpr bool value = B;
};

template <class Body>
__device__ __forceinline__ void with_truncation(const float* theta, Body&& body) {
  if (theta != nullptr) {
    body(Truncated<true>{});
  } else {
    body(Truncated<false>{});
  }
}

}  // namespace megarl
