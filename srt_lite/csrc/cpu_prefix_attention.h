// The shared-prefix part of a cascade step (cpu_prefix_attention.cpp), called by
// cpu_attention.cpp's cascade op.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace srt_lite_prefix {

// Which products the kernel runs: kAuto takes AMX tiles where the CPU has them and
// SRT_LITE_CPU_CAPS leaves them (allow_kernels), else AVX512-BF16 vectors, else nothing.
enum class Kernel { kAuto, kTiles, kVectors };

// What SRT_LITE_CPU_CAPS leaves this kernel, which chooses for itself in C++: set from Python
// when the ops load, so a capped run takes the paths a lesser CPU would.
void allow_kernels(bool tiles, bool vectors);

// Whether AVX512-BF16 vector products may run here: in the CPU and left by SRT_LITE_CPU_CAPS.
bool bf16_vectors_allowed();

// Softmax attention of every query of a cascade step over the prefix all its rows share:
// q [>= T, Hkv * G * D] bf16, the prefix prefix_len slots of k_buf / v_buf [N, Hkv, D] from
// prefix_start, or the slots prefix_index when prefix_start < 0. Sets o [1, Hkv, T * G, D]
// fp32 and lse [1, Hkv, T * G] (query t * G + g of KV head h is head h * G + g of token t),
// as flash attention returns them. Returns false, computing nothing, where the kernel does
// not apply (no kernel for this CPU, not bf16, head_dim not a multiple of 32 or over 256);
// the caller then takes torch's flash attention.
bool attention(const at::Tensor& q, int64_t T, int64_t G, const at::Tensor& k_buf, const at::Tensor& v_buf,
               int64_t prefix_start, int64_t prefix_len, const at::Tensor& prefix_index, double scale, at::Tensor& o,
               at::Tensor& lse, Kernel kernel = Kernel::kAuto);

}  // namespace srt_lite_prefix
