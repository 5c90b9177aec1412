// The softmax and log-sum-exp arithmetic of the attention kernels (cpu_attention.cpp,
// cpu_prefix_attention.cpp, cpu_prompt_attention.cpp), in one copy: a cascade merges the
// prefix kernel's output with the suffix kernel's, and batch-invariant inference needs a
// row's result to be the same bits whichever kernel or batch computed it, so every kernel
// must round in the same order.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// Forced inline so that a caller's target attribute (the AVX512-BF16 kernels) also covers
// the lambda it hands to exp_sum; a copy compiled on its own could not inline that lambda.
#if defined(__GNUC__)
#define SRT_LITE_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define SRT_LITE_ALWAYS_INLINE inline
#endif

namespace srt_lite_attn {

using Vec = at::vec::Vectorized<float>;

SRT_LITE_ALWAYS_INLINE float reduce_max(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, v);
}

SRT_LITE_ALWAYS_INLINE float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// s[n, width) = -inf, for keys a query may not see and the padding to whole vectors; returns
// the max of s[0, width). width is a multiple of Vec::size().
SRT_LITE_ALWAYS_INLINE float masked_max(float* s, int64_t n, int64_t width) {
  constexpr int64_t W = Vec::size();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = n; j < width; ++j) s[j] = neg_inf;
  Vec vmax(neg_inf);
  for (int64_t j = 0; j < width; j += W) vmax = at::vec::maximum(vmax, Vec::loadu(s + j));
  return reduce_max(vmax);
}

// masked_max of scores that leave their product unscaled: s[0, width) is scaled in place
// (the -inf padding stays -inf for a positive scale).
SRT_LITE_ALWAYS_INLINE float masked_scaled_max(float* s, int64_t n, int64_t width, float scale) {
  constexpr int64_t W = Vec::size();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = n; j < width; ++j) s[j] = neg_inf;
  Vec vmax(neg_inf);
  for (int64_t j = 0; j < width; j += W) {
    const Vec x = Vec::loadu(s + j) * Vec(scale);
    x.store(s + j);
    vmax = at::vec::maximum(vmax, x);
  }
  return reduce_max(vmax);
}

// The probabilities exp(s[j] - mx) of s[0, width), a vector at a time to emit(j, e) (which
// stores them in the caller's precision); returns their sum.
template <typename Emit>
SRT_LITE_ALWAYS_INLINE float exp_sum(const float* s, int64_t width, float mx, Emit&& emit) {
  constexpr int64_t W = Vec::size();
  Vec vsum(0.f);
  for (int64_t j = 0; j < width; j += W) {
    const Vec e = (Vec::loadu(s + j) - Vec(mx)).exp_u20();
    emit(j, e);
    vsum = vsum + e;
  }
  return reduce_sum(vsum);
}

// A row's max score and exp-sum: the unnormalised softmax exp(s - max) / sum.
struct RowSums {
  float max, sum;
};

// The softmax of one row of scores over its first n keys, left unnormalised in s[0, width)
// (zero from n on).
SRT_LITE_ALWAYS_INLINE RowSums softmax_row(float* s, int64_t n, int64_t width) {
  const float mx = masked_max(s, n, width);
  const float sum = exp_sum(s, width, mx, [s](int64_t j, const Vec& e) { e.store(s + j); });
  return {mx, sum};
}

// ---- merging partial results over disjoint key sets ---------------------------------------

// The log-sum-exp of a part's scaled scores, from its max and exp-sum.
inline float part_lse(float max, float sum) { return max + std::log(sum); }

// Of two parts, the share of the softmax mass that part a holds: sigmoid(lse_a - lse_b).
inline float first_share(float lse_a, float lse_b) { return 1.f / (1.f + std::exp(lse_b - lse_a)); }

// One query's n parts merged into dst [D]: part c has max max[c * step], exp-sum
// sum[c * step] and unnormalised output acc[c * acc_step .. + D). Each part weighs
// exp(max_c - max) * sum_c of the total; returns the merged lse. w: scratch [n].
inline float merge_parts(int64_t n, const float* max, const float* sum, int64_t step, const float* acc,
                         int64_t acc_step, int64_t D, float* w, float* dst) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < n; ++c) mx = std::max(mx, max[c * step]);
  float total = 0.f;
  for (int64_t c = 0; c < n; ++c) {
    w[c] = std::exp(max[c * step] - mx);
    total += w[c] * sum[c * step];
  }
  std::memset(dst, 0, D * sizeof(float));
  for (int64_t c = 0; c < n; ++c) {
    const float wc = w[c] / total;
    const float* src = acc + c * acc_step;
    for (int64_t d = 0; d < D; ++d) dst[d] += wc * src[d];
  }
  return part_lse(mx, total);
}

}  // namespace srt_lite_attn
