// The 4-bit panel layout both 4-bit panel kernels read (amx_int4_panel_linear in
// cpu_amx_linear.cpp, int4_panel_linear in cpu_int4_linear.cpp), as pack_int4_panels in
// layers/linear.py writes it:
//   codes [N / 64, K / 4, 4, 32] uint8: for each two k pairs and each of a panel's four
//   16-output vectors, 32 bytes whose byte j holds element j of the first pair's vector in
//   its low nibble and of the second's in its high one, element e being output e / 2 of the
//   vector at k 2p + e % 2 (the bf16 panel layout's order, and an AMX B tile's rows);
//   sz [N / 64, K / 32, 2, 64] fp32: each group's scale, then zero, for the panel's outputs.
// A GGUF Q4_0 / Q4_1 weight is w = (q - 8) * scale + zero per group of 32 k. Both kernels
// take q - 8 as bf16 (exact) and scale each group's products after:
// x . w = scale * (x . (q - 8)) + zero * sum(x) over the group's 32 k, in fp32.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

// The arguments both 4-bit panel ops take, checked alike: x [M, K] bf16, codes
// [N / 64, K / 4, 4, 32] uint8, sz [N / 64, K / 32, 2, 64] fp32, bias [N] or none. Returns K.
inline int64_t check_int4_panel_args(const char* op, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                                     const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.is_contiguous() && codes.size(2) == 4 &&
                  codes.size(3) == 32,
              op, ": codes must be a contiguous uint8 [N / 64, K / 4, 4, 32]");
  const int64_t P = codes.size(0), K = 4 * codes.size(1);
  TORCH_CHECK(K % 32 == 0, op, ": K = ", K, " is not a multiple of 32");
  TORCH_CHECK(sz.scalar_type() == at::kFloat && sz.is_contiguous() && sz.dim() == 4 && sz.size(0) == P &&
                  sz.size(1) == K / 32 && sz.size(2) == 2 && sz.size(3) == 64,
              op, ": sz must be a contiguous fp32 [N / 64, K / 32, 2, 64]");
  TORCH_CHECK(N > (P - 1) * 64 && N <= P * 64, op, ": N = ", N, " does not fit ", P, " panels");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == K, op, ": x must be bf16 [M, ", K, "]");
  TORCH_CHECK(!(bias.has_value() && bias->defined()) || bias->numel() == N, op, ": bias must be [N]");
  return K;
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
#define SRT_LITE_HAVE_INT4_PANELS 1
#include <immintrin.h>

namespace srt_lite_int4 {

constexpr int64_t kPanelRows = 64;   // outputs of a panel
constexpr int64_t kGroupPairs = 16;  // k pairs of a group of 32 weights
constexpr int64_t kGroupVector = kGroupPairs * 32;  // bf16 of one 16-output vector's group
constexpr int64_t kGroupCodeBytes = kPanelRows * 2 * kGroupPairs / 2;  // a panel's codes of one group

// bf16 of code - 8 for codes 0..15 (lanes 16-31 repeat them: vpermw reads the low 5 bits).
alignas(64) constexpr uint16_t kCodeValues[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

// values [4][16 k pairs][16 outputs x 2] bf16 = q - 8 of one group of a panel (codes: its
// kGroupCodeBytes), for the panel's vectors [b0, b0 + nb) (the others are left as they are).
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void group_values(const uint8_t* codes, uint16_t* values, int64_t b0, int64_t nb) {
  const __m512i table = _mm512_load_si512(kCodeValues);
  const __m512i nibble = _mm512_set1_epi16(0xF);
  for (int64_t i = 0; i < kGroupPairs / 2; ++i) {
    for (int64_t b = b0; b < b0 + nb; ++b) {
      const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (i * 4 + b) * 32)));
      uint16_t* t = values + b * kGroupVector + 2 * i * 32;
      _mm512_store_si512(t, _mm512_permutexvar_epi16(_mm512_and_si512(c, nibble), table));
      _mm512_store_si512(t + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(c, 4), table));
    }
  }
}

// xsum [M, K / 32] = each row's sum of x over each group, in fp32.
__attribute__((target("avx512f,avx512bw")))
inline void group_sums(const uint16_t* x, int64_t M, int64_t K, float* xsum) {
  const int64_t groups = K / (2 * kGroupPairs);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i v = _mm512_loadu_si512(x + r * K + g * 32);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
      xsum[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
}

}  // namespace srt_lite_int4
#endif
