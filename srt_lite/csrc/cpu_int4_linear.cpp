// srt_lite_cpu::int4_panel_linear: the product of amx_int4_panel_linear (the same 4-bit
// panels, the same per-group scaling, cpu_int4.h) for CPUs with AVX512-BF16 but no AMX.
//
// At decode's few rows a bf16 product is bound by reading its weight; the 4-bit panels are
// a third of its bytes. Widening each weight to bf16 with its scale and zero would cost a
// multiply, an add and a rounding per weight, so a group's q - 8 (exact in bf16) is looked
// up once per group and panel into L1, every tile of rows takes it through `vdpbf16ps`, and
// the group's sums are scaled after. Each output's groups are added in order, so a row's
// result does not depend on the other rows of the batch, nor on how many there are.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_int4.h"

namespace {

#ifdef SRT_LITE_HAVE_INT4_PANELS
using srt_lite_int4::kGroupCodeBytes;
using srt_lite_int4::kGroupPairs;
using srt_lite_int4::kGroupVector;
using srt_lite_int4::kPanelRows;

// Rows of x whose sums a pass over the weight keeps ([rows, 64] fp32 a thread).
constexpr int64_t kChunkRows = 128;
// Groups ahead whose codes and scales are asked for before they are read: a group is little
// work at a few rows, and the hardware prefetcher alone leaves the loop waiting on memory.
constexpr int64_t kPrefetchGroups = 4;

inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
}

struct Int4Args {
  const uint16_t* x;     // [M, K]
  const uint8_t* codes;  // [N / 64, K / 4, 4, 32]
  const float* sz;       // [N / 64, K / 32, 2, 64]
  const float* xsum;     // [M, K / 32]
  const float* bias;     // [N] or null
  uint16_t* out;         // [M, N]
  int64_t N, K;
};

// acc [MR, 64] (the vectors [b0, b0 + NB)) += scale * (x . values) + zero * xsum for one
// group: x at the group's first k of row 0 (K apart), xsum at the group's sum of row 0
// (`groups` apart), scale and zero the group's [64].
template <int MR, int NB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void group_step(const uint16_t* x, int64_t K, const uint16_t* values, int64_t b0, const float* scale, const float* zero,
                const float* xsum, int64_t groups, float* acc, bool first) {
  __m512 c[MR][NB];
  for (int m = 0; m < MR; ++m) {
    for (int b = 0; b < NB; ++b) c[m][b] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < kGroupPairs; ++p) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_load_si512(values + (b0 + b) * kGroupVector + p * 32);
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * K + 2 * p, sizeof(pair));
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(pair));
      for (int b = 0; b < NB; ++b) c[m][b] = _mm512_dpbf16_ps(c[m][b], (__m512bh)xb, (__m512bh)wv[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const __m512 s = _mm512_loadu_ps(scale + (b0 + b) * 16), z = _mm512_loadu_ps(zero + (b0 + b) * 16);
    for (int m = 0; m < MR; ++m) {
      float* o = acc + m * kPanelRows + (b0 + b) * 16;
      const __m512 base = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
      const __m512 xs = _mm512_set1_ps(xsum[m * groups]);
      _mm512_storeu_ps(o, _mm512_fmadd_ps(xs, z, _mm512_fmadd_ps(c[m][b], s, base)));
    }
  }
}

// group_step for a tile of `rows` rows: up to 6 against a whole panel (NB = 4), up to 8
// against half of one (NB = 2), so the sums, the weight vectors and the x broadcast stay in
// the 32 vector registers.
template <int NB>
void group_rows(int64_t rows, const uint16_t* x, int64_t K, const uint16_t* values, int64_t b0, const float* scale,
                const float* zero, const float* xsum, int64_t groups, float* acc, bool first) {
  switch (rows) {
    case 1: return group_step<1, NB>(x, K, values, b0, scale, zero, xsum, groups, acc, first);
    case 2: return group_step<2, NB>(x, K, values, b0, scale, zero, xsum, groups, acc, first);
    case 3: return group_step<3, NB>(x, K, values, b0, scale, zero, xsum, groups, acc, first);
    case 4: return group_step<4, NB>(x, K, values, b0, scale, zero, xsum, groups, acc, first);
    case 5: return group_step<5, NB>(x, K, values, b0, scale, zero, xsum, groups, acc, first);
    case 6: return group_step<6, NB>(x, K, values, b0, scale, zero, xsum, groups, acc, first);
  }
  if constexpr (NB == 2) {
    switch (rows) {
      case 7: return group_step<7, NB>(x, K, values, b0, scale, zero, xsum, groups, acc, first);
      case 8: return group_step<8, NB>(x, K, values, b0, scale, zero, xsum, groups, acc, first);
    }
  }
  TORCH_CHECK(false, "int4_panel_linear: no tile of ", rows, " rows");
}

// out rows [r0, r1) of the vectors [b0, b0 + nb) of a panel = acc + bias, rounded to nearest
// even; outputs past N (the panel's padding) are not written.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void store_vectors(const Int4Args& a, const float* acc, int64_t panel, int64_t b0, int64_t nb, int64_t r0, int64_t r1) {
  for (int64_t b = b0; b < b0 + nb; ++b) {
    const int64_t n = panel * kPanelRows + b * 16;
    if (n >= a.N) break;
    const __mmask16 mask = a.N - n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (a.N - n)) - 1);
    const __m512 bv = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n) : _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; ++r) {
      const __m512 y = _mm512_add_ps(_mm512_loadu_ps(acc + (r - r0) * kPanelRows + b * 16), bv);
      _mm256_mask_storeu_epi16(a.out + r * a.N + n, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

// MR rows (one or two) against the vectors [b0, b0 + NB) of a panel, all its groups, into
// acc [MR, 64] (the panel's sums). With so few rows a group's values serve one or two
// products, so they are widened in registers instead of through L1, and the sums stay in
// registers from group to group. The arithmetic is group_step's, in its order (the pairs of
// a group one after another into one sum per row and vector, then sum * scale + base, then
// + zero * xsum): a row gets the same bits here as in a tile of any size.
template <int MR, int NB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void few_rows(const uint16_t* x, int64_t K, const uint8_t* codes, const float* sz, const float* xsum, int64_t groups,
              int64_t b0, float* acc) {
  const __m512i table = _mm512_load_si512(srt_lite_int4::kCodeValues);
  const __m512i nibble = _mm512_set1_epi16(0xF);
  __m512 sums[MR][NB];
  for (int m = 0; m < MR; ++m) {
    for (int b = 0; b < NB; ++b) sums[m][b] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gc = codes + g * kGroupCodeBytes;
    if (g + kPrefetchGroups < groups) {
      prefetch_lines(gc + kPrefetchGroups * kGroupCodeBytes, kGroupCodeBytes);
      prefetch_lines(sz + (g + kPrefetchGroups) * 2 * kPanelRows, 2 * kPanelRows * sizeof(float));
    }
    __m512 c[MR][NB];
    for (int m = 0; m < MR; ++m) {
      for (int b = 0; b < NB; ++b) c[m][b] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < kGroupPairs / 2; ++i) {
      __m512i x0[MR], x1[MR];  // row m's k pairs 2i and 2i + 1, broadcast
      for (int m = 0; m < MR; ++m) {
        uint32_t pairs[2];
        std::memcpy(pairs, x + m * K + g * 32 + 4 * i, sizeof(pairs));
        x0[m] = _mm512_set1_epi32(static_cast<int>(pairs[0]));
        x1[m] = _mm512_set1_epi32(static_cast<int>(pairs[1]));
      }
      for (int b = 0; b < NB; ++b) {
        const __m512i cw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gc + (i * 4 + b0 + b) * 32)));
        const __m512i lo = _mm512_permutexvar_epi16(_mm512_and_si512(cw, nibble), table);  // pair 2i
        const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(cw, 4), table);      // pair 2i + 1
        for (int m = 0; m < MR; ++m) {
          c[m][b] = _mm512_dpbf16_ps(c[m][b], (__m512bh)x0[m], (__m512bh)lo);
          c[m][b] = _mm512_dpbf16_ps(c[m][b], (__m512bh)x1[m], (__m512bh)hi);
        }
      }
    }
    const float* scale = sz + g * 2 * kPanelRows;
    for (int b = 0; b < NB; ++b) {
      const __m512 s = _mm512_loadu_ps(scale + (b0 + b) * 16), z = _mm512_loadu_ps(scale + kPanelRows + (b0 + b) * 16);
      for (int m = 0; m < MR; ++m) {
        sums[m][b] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * groups + g]), z, _mm512_fmadd_ps(c[m][b], s, sums[m][b]));
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(acc + m * kPanelRows + (b0 + b) * 16, sums[m][b]);
  }
}

// Rows up to which few_rows takes a chunk: from three rows on, widening a group's values
// once into L1 for all of them costs less than widening them for each pair of rows.
constexpr int64_t kFewRows = 2;

// Work units are whole panels (NB = 4), or half panels (NB = 2) when there are too few
// panels to share between the threads; each group's values serve every tile of rows.
template <int NB>
void int4_matmul(const Int4Args& a, int64_t M) {
  const int64_t groups = a.K / (2 * kGroupPairs), panels = (a.N + kPanelRows - 1) / kPanelRows;
  const int64_t parts = 4 / NB, units = panels * parts, tile = NB == 2 ? 8 : 6;
  for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
    const int64_t c1 = std::min(M, c0 + kChunkRows);
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      alignas(64) static thread_local float acc[kChunkRows * kPanelRows];  // [rows, 64] sums
      alignas(64) static thread_local uint16_t values[4 * kGroupVector];   // [4, 16, 32] bf16 q - 8
      for (int64_t u = begin; u < end; ++u) {
        const int64_t panel = u / parts, b0 = (u % parts) * NB;
        if (c1 - c0 <= kFewRows) {
          auto* rows = c1 - c0 == 1 ? &few_rows<1, NB> : &few_rows<2, NB>;
          rows(a.x + c0 * a.K, a.K, a.codes + panel * groups * kGroupCodeBytes, a.sz + panel * groups * 2 * kPanelRows,
               a.xsum + c0 * groups, groups, b0, acc);
          store_vectors(a, acc, panel, b0, NB, c0, c1);
          continue;
        }
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t ahead = panel * groups + g + kPrefetchGroups;
          if (ahead < panels * groups) {
            prefetch_lines(a.codes + ahead * kGroupCodeBytes, kGroupCodeBytes);
            prefetch_lines(a.sz + ahead * 2 * kPanelRows, 2 * kPanelRows * sizeof(float));
          }
          srt_lite_int4::group_values(a.codes + (panel * groups + g) * kGroupCodeBytes, values, b0, NB);
          const float* scale = a.sz + (panel * groups + g) * 2 * kPanelRows;
          for (int64_t m0 = c0; m0 < c1; m0 += tile) {
            group_rows<NB>(std::min(tile, c1 - m0), a.x + m0 * a.K + g * 32, a.K, values, b0, scale, scale + kPanelRows,
                           a.xsum + m0 * groups + g, groups, acc + (m0 - c0) * kPanelRows, g == 0);
          }
        }
        store_vectors(a, acc, panel, b0, NB, c0, c1);
      }
    });
  }
}
#endif

bool int4_panels_supported() {
#ifdef SRT_LITE_HAVE_INT4_PANELS
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// x [M, K] bf16, codes [N / 64, K / 4, 4, 32] uint8 and sz [N / 64, K / 32, 2, 64] fp32
// (pack_int4_panels in linear.py), bias [N] or none -> [M, N] bf16; fp32 accumulation.
at::Tensor int4_panel_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                             const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(int4_panels_supported(), "int4_panel_linear: this CPU (or build) has no AVX512-BF16");
  const int64_t K = check_int4_panel_args("int4_panel_linear", x, codes, sz, bias, N);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());  // [M, N]
#ifdef SRT_LITE_HAVE_INT4_PANELS
  if (M == 0) return out;
  const int64_t P = codes.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  at::Tensor xsum = at::empty({M, K / 32}, x.options().dtype(at::kFloat));  // [M, K / 32]
  srt_lite_int4::group_sums(xp, M, K, xsum.data_ptr<float>());
  at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();  // [N] fp32
  const Int4Args args{xp, codes.data_ptr<uint8_t>(), sz.data_ptr<float>(), xsum.data_ptr<float>(),
                      has_bias ? bf.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()),
                      N, K};
  // Half panels where whole ones would leave a thread idle for much of the product.
  if (P < 8 * at::get_num_threads()) {
    int4_matmul<2>(args, M);
  } else {
    int4_matmul<4>(args, M);
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def("int4_panel_linear(Tensor x, Tensor codes, Tensor sz, Tensor? bias, int N) -> Tensor");
  m.def("int4_panels_supported() -> bool");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) { m.impl("int4_panel_linear", &int4_panel_linear); }

TORCH_LIBRARY_IMPL(srt_lite_cpu, CompositeExplicitAutograd, m) { m.impl("int4_panels_supported", &int4_panels_supported); }
