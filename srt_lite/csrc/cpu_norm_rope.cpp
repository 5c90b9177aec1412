// A decoder layer's small elementwise ops on CPU: the residual add with RMSNorm, RoPE, and
// SiLU-and-mul, each one call instead of the 4-10 torch ops (and their temporaries) that
// compute it in Python. At decode each of those ops touches a few kilobytes, so a layer's
// time went to their dispatch, not their arithmetic.
//
// Each op rounds where the torch ops it replaces round (every torch op returns a tensor in
// the activation dtype), so the results are theirs: in bf16 and fp16 bit for bit, apart
// from the order of the RMSNorm sum of squares (computed in fp32 either way).
// Built with the other csrc files into one extension by srt_lite/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
constexpr int64_t kChunk = 2 * kW;  // elements of T loaded at once, as two float vectors

// n <= kChunk elements of T at p as two float vectors (zero past n).
template <typename T>
inline void load2(const T* p, int64_t n, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = Vec::loadu(p, std::min(n, kW));
    hi = n > kW ? Vec::loadu(p + kW, n - kW) : Vec(0.f);
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, n));
  }
}

// The first n of lo, hi rounded to T and stored at p.
template <typename T>
inline void store2(T* p, int64_t n, const Vec& lo, const Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(p, std::min(n, kW));
    if (n > kW) hi.store(p + kW, n - kW);
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(p, n);
  }
}

// lo, hi rounded to T and widened again: what a torch op's T result holds.
template <typename T>
inline void round2(Vec& lo, Vec& hi) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
  }
}

// Rows of n elements handed to one task: enough that a task's set-up is small next to it.
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(n, 1)); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), name, ": contiguous rows");
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK(t == at::kBFloat16 || t == at::kHalf || t == at::kFloat, name, ": bf16, fp16 or fp32");
}

// f(T{}) for the activation dtypes these ops take (check_rows has checked t).
template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: return f(float{});
  }
}

// out = weight * round(rmsnorm(h)), h = x (+ residual, rounded, also written to h_out), as
// RMSNorm in srt_lite/layers/layernorm.py: normalised in fp32, rounded to T, scaled by the
// weight in T.
template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* h_out, int64_t rows, int64_t n,
                   float eps) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> h;  // the row in fp32, kept between calls: no allocation a norm
    if (h.size() < static_cast<size_t>(n + kChunk)) h.resize(n + kChunk);
    for (int64_t r = begin; r < end; ++r) {
      Vec ss(0.f);
      for (int64_t i = 0; i < n; i += kChunk) {
        const int64_t c = std::min(kChunk, n - i);
        Vec lo, hi;
        load2(x + r * n + i, c, lo, hi);
        if (residual != nullptr) {
          Vec rlo, rhi;
          load2(residual + r * n + i, c, rlo, rhi);
          lo = lo + rlo;
          hi = hi + rhi;
          round2<T>(lo, hi);
          store2(h_out + r * n + i, c, lo, hi);
        }
        lo.store(h.data() + i);
        hi.store(h.data() + i + kW);
        ss = at::vec::fmadd(lo, lo, at::vec::fmadd(hi, hi, ss));  // zero past n
      }
      const float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, ss);
      const Vec inv(1.f / std::sqrt(sum / static_cast<float>(n) + eps));
      for (int64_t i = 0; i < n; i += kChunk) {
        const int64_t c = std::min(kChunk, n - i);
        Vec lo = Vec::loadu(h.data() + i) * inv, hi = Vec::loadu(h.data() + i + kW) * inv;
        round2<T>(lo, hi);
        Vec wlo, whi;
        load2(weight + i, c, wlo, whi);
        store2(out + r * n + i, c, wlo * lo, whi * hi);
      }
    }
  });
}

}  // namespace

namespace srt_lite_ops {

// rms_norm_rows over tensors: x and, with a residual, h_out = x + residual (h_out may be the
// residual itself); out = the normalised rows.
void rms_norm_into(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                   at::Tensor& out, at::Tensor* h_out) {
  const char* name = residual ? "add_rms_norm" : "rms_norm";
  check_rows(x, name);
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == x.scalar_type() && weight.is_contiguous(), name,
              ": weight [", n, "] in x's dtype");
  const auto like_x = [&](const at::Tensor& t) {
    return t.numel() == x.numel() && t.scalar_type() == x.scalar_type() && t.is_contiguous();
  };
  TORCH_CHECK(like_x(out) && (!residual || (like_x(*residual) && h_out && like_x(*h_out))), name,
              ": residual and outputs like x");
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            residual ? h_out->data_ptr<scalar_t>() : nullptr, x.numel() / n, n, static_cast<float>(eps));
  });
}


// x [T, heads, D] with contiguous heads, cos / sin [T, D] (the [cos, cos] and [-sin, sin]
// rows of RotaryEmbedding, in x's dtype) -> out [T, heads, D] = x * cos + rotate_half(x) * sin,
// each product and the sum rounded to T as the torch ops round.
void rope_into(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope: x [T, heads, D] with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D &&
      cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rope: cos / sin [T, D] in x's dtype");
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK(t == at::kBFloat16 || t == at::kHalf || t == at::kFloat, "rope: bf16, fp16 or fp32");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == t && out.is_contiguous(), "rope: out [T, heads, D] like x");
  dispatch(t, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, T * H, row_grain(D), [&](int64_t begin, int64_t end) {
      for (int64_t th = begin; th < end; ++th) {
        const int64_t tok = th / H, h = th % H;
        const scalar_t* x1 = xp + tok * xs + h * D;  // first half; x2 = x1 + half
        const scalar_t* c = cp + tok * D;
        const scalar_t* s = sp + tok * D;
        scalar_t* o = op + th * D;
        for (int64_t i = 0; i < half; i += kChunk) {
          const int64_t n = std::min(kChunk, half - i);
          Vec a_lo, a_hi, b_lo, b_hi, c1_lo, c1_hi, s1_lo, s1_hi, c2_lo, c2_hi, s2_lo, s2_hi;
          load2(x1 + i, n, a_lo, a_hi);
          load2(x1 + half + i, n, b_lo, b_hi);
          load2(c + i, n, c1_lo, c1_hi);
          load2(s + i, n, s1_lo, s1_hi);
          load2(c + half + i, n, c2_lo, c2_hi);
          load2(s + half + i, n, s2_lo, s2_hi);
          // out1 = x1 * c1 + x2 * s1, out2 = x2 * c2 + x1 * s2 (rotate_half swaps the halves)
          Vec p_lo = a_lo * c1_lo, p_hi = a_hi * c1_hi, q_lo = b_lo * s1_lo, q_hi = b_hi * s1_hi;
          round2<scalar_t>(p_lo, p_hi);
          round2<scalar_t>(q_lo, q_hi);
          store2(o + i, n, p_lo + q_lo, p_hi + q_hi);
          p_lo = b_lo * c2_lo, p_hi = b_hi * c2_hi, q_lo = a_lo * s2_lo, q_hi = a_hi * s2_hi;
          round2<scalar_t>(p_lo, p_hi);
          round2<scalar_t>(q_lo, q_hi);
          store2(o + half + i, n, p_lo + q_lo, p_hi + q_hi);
        }
      }
    });
  });
}


// x [.., 2d] (gate | up) -> silu(gate) * up [.., d], silu rounded to T before the product as
// F.silu(...) * up rounds; silu computed as torch's vectorised kernel computes it.
void silu_and_mul_into(const at::Tensor& x, at::Tensor& out) {
  check_rows(x, "silu_and_mul");
  const int64_t n2 = x.size(-1), d = n2 / 2;
  TORCH_CHECK(n2 % 2 == 0, "silu_and_mul: an even last dimension");
  const int64_t rows = x.numel() / n2;
  TORCH_CHECK(out.numel() == rows * d && out.scalar_type() == x.scalar_type() && out.is_contiguous(),
              "silu_and_mul: out [.., ", d, "] in x's dtype");
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
      const Vec one(1.f);  // silu(g) = g / (1 + exp(-g))
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = xp + r * n2;
        int64_t i = 0;
        for (; i + kChunk <= d; i += kChunk) {
          Vec g_lo, g_hi, u_lo, u_hi;
          load2(gate + i, kChunk, g_lo, g_hi);
          load2(gate + d + i, kChunk, u_lo, u_hi);
          g_lo = g_lo / (one + g_lo.neg().exp());
          g_hi = g_hi / (one + g_hi.neg().exp());
          round2<scalar_t>(g_lo, g_hi);
          store2(op + r * d + i, kChunk, g_lo * u_lo, g_hi * u_hi);
        }
        for (; i < d; ++i) {  // the tail as torch's kernel computes it, one element at a time
          const float g = static_cast<float>(gate[i]);
          const float silu = static_cast<float>(static_cast<scalar_t>(g / (1.f + std::exp(-g))));
          op[r * d + i] = static_cast<scalar_t>(silu * static_cast<float>(gate[d + i]));
        }
      }
    });
  });
}

}  // namespace srt_lite_ops

namespace {

// x [.., n], weight [n] -> RMSNorm(x) (see rms_norm_rows).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(x);
  srt_lite_ops::rms_norm_into(x, nullptr, weight, eps, out, nullptr);
  return out;
}

// (RMSNorm(x + residual), x + residual): the decoder layer's residual stream and the next
// sublayer's input in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                                double eps) {
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual like x");
  at::Tensor out = at::empty_like(x), h = at::empty_like(x);
  srt_lite_ops::rms_norm_into(x, &residual, weight, eps, out, &h);
  return {out, h};
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out = at::empty(x.sizes(), x.options());  // [T, heads, D]
  srt_lite_ops::rope_into(x, cos, sin, out);
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "silu_and_mul: contiguous rows");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, x.options());  // [.., d]
  srt_lite_ops::silu_and_mul_into(x, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_and_mul", &silu_and_mul);
}
