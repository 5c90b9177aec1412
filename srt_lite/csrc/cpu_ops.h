// The ops the C++ decoder stack (cpu_decoder.cpp) calls between its products, as plain
// functions: the same code the registered torch ops run, with their results written into
// tensors the caller holds. A one-row step calls a hundred of them between products that
// stream the weights through the caches; called through the dispatcher, each allocating its
// outputs, they met cold code and cold allocator state every time.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace srt_lite_ops {

// cpu_norm_rope.cpp. out = RMSNorm(x (+ residual)) as srt_lite_cpu::rms_norm / add_rms_norm
// compute it; with a residual, x + residual (rounded to x's dtype) is written to h_out, which
// may be the residual itself. x, residual, out, h_out: contiguous [.., n] in weight's dtype.
void rms_norm_into(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                   at::Tensor& out, at::Tensor* h_out);

// srt_lite_cpu::rope into out [T, heads, D] (contiguous).
void rope_into(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out);

// srt_lite_cpu::silu_and_mul into out [.., d] (contiguous).
void silu_and_mul_into(const at::Tensor& x, at::Tensor& out);

// cpu_attention.cpp: srt_lite_cpu::cascade_attention.
void cascade_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_buf,
                       at::Tensor v_buf, const at::Tensor& loc, const at::Tensor& suffix_index, const at::Tensor& q_off,
                       const at::Tensor& k_off, int64_t prefix_start, int64_t prefix_len,
                       const at::Tensor& prefix_index, int64_t num_heads, double scale, at::Tensor out);

// cpu_gguf_linear.cpp: srt_lite_cpu::gguf_linear_registered, written into `out` where it is
// [M, N] contiguous in x's dtype and the rows take the integer products; else into a new
// tensor, as the op returns it.
at::Tensor gguf_linear_registered(const at::Tensor& x, int64_t key, const std::optional<at::Tensor>& bias,
                                  const at::Tensor& out);

}  // namespace srt_lite_ops
