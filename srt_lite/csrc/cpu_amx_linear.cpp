// srt_lite_cpu::amx_panel_linear: the bf16 panel product (see panel_linear in cpu_linear.cpp)
// on AMX tiles.
//
// The panel layout, [N / 64, K / 2, 64, 2], already holds AMX's B operand: 16 k pairs of 16
// outputs are a 16 x 64-byte tile at a 256-byte stride, and a panel's 64 outputs are four of
// them side by side. So the weight keeps the one copy the AVX-512 kernel reads, and a tile of
// up to 16 input rows takes four `tdpbf16ps` per 16 k pairs into four fp32 accumulator tiles.
// At decode's few rows the product is bound by reading the weight, which the tiles stream
// faster than oneDNN's AMX kernels do (docs/benchmarks.md, "AMX panels"); at a prefill's
// hundreds of rows the weight's k range stays in L1 while every tile of rows passes over it.
//
// Each output accumulates its k pairs in order in one fp32 tile row, with partial sums stored
// and reloaded exactly between k ranges: a row's result does not depend on the other rows of
// the batch, nor on how many there are.
//
// srt_lite_cpu::amx_int4_panel_linear: the same product over a GGUF's 4-bit weights (Q4_0 /
// Q4_1, as gguf_quant reads them: w = (q - 8) * scale + zero per group of 32 k), read at a
// third of bf16's bytes. Widening each weight to bf16 (a multiply, an add and a rounding)
// costs more than reading bf16 does, so the tiles take q - 8 itself, exact in bf16 and
// looked up 32 at a time from the codes, and each group's products are scaled after:
// x . w = scale * (x . (q - 8)) + zero * sum(x) over the group's 32 k, in fp32. This is
// within fp32 rounding of the 4-bit weights' exact product (not of the bf16-rounded
// dequantized ones), and a row's result does not depend on its batch either.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_amx.h"
#include "cpu_int4.h"

namespace {

constexpr int64_t kPanelRows = 64;  // outputs of a panel (kPanelRows in cpu_linear.cpp)
constexpr int64_t kTileRows = 16;   // input rows of an A tile (AMX's maximum)
constexpr int64_t kTilePairs = 16;  // k pairs of one A / B tile (64 bytes of bf16 pairs a row)

#ifdef SRT_LITE_HAVE_AMX
// Rows of x taken per pass over the weight (their partial sums fit a thread's scratch).
constexpr int64_t kChunkRows = 128;
// k pairs of a panel taken per pass over the chunk's tiles of rows when there are several:
// 128 pairs of 64 outputs are 32 KB, which stay in L1 while each tile reads them. One tile
// (decode) takes the whole k range, saving the reload of its partial sums.
constexpr int64_t kChunkPairsManyRows = 128;
constexpr int64_t kChunkPairsOneTile = 1 << 20;

using srt_lite_amx::release_tiles;
using srt_lite_amx::TileConfig;

// Tiles 0-3: the accumulators of rows x 16 outputs (fp32); 4: x, rows x 16 k pairs; 5-7: the
// weight, 16 k pairs x 16 outputs (tile 5 is loaded twice per step, for outputs 0-15 and 48-63).
__attribute__((target("amx-tile,amx-bf16")))
void configure_tiles(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 8; ++t) {
    cfg.rows[t] = kTilePairs;
    cfg.colsb[t] = 64;
  }
  srt_lite_amx::load_config(cfg);
}

// partial [rows, 64] fp32 (+)= x [rows, 2 * pairs] (ldx_bytes apart) . the panel's k pairs
// [0, pairs) at w (256 bytes a pair); `first` starts from zero instead of partial.
__attribute__((target("amx-tile,amx-bf16")))
void tile_step(const uint16_t* x, int64_t ldx_bytes, const uint16_t* w, int64_t pairs, float* partial, bool first) {
  constexpr int64_t ldc_bytes = kPanelRows * sizeof(float);
  constexpr int64_t ldw_bytes = kPanelRows * 2 * sizeof(uint16_t);
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, partial, ldc_bytes);
    _tile_loadd(1, partial + 16, ldc_bytes);
    _tile_loadd(2, partial + 32, ldc_bytes);
    _tile_loadd(3, partial + 48, ldc_bytes);
  }
  for (int64_t p = 0; p < pairs; p += kTilePairs) {
    const uint16_t* wp = w + p * 2 * kPanelRows;
    _tile_loadd(4, x + 2 * p, ldx_bytes);
    _tile_loadd(5, wp, ldw_bytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wp + 32, ldw_bytes);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, wp + 64, ldw_bytes);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, wp + 96, ldw_bytes);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, partial, ldc_bytes);
  _tile_stored(1, partial + 16, ldc_bytes);
  _tile_stored(2, partial + 32, ldc_bytes);
  _tile_stored(3, partial + 48, ldc_bytes);
}

struct AmxArgs {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [N / 64, K / 2, 64, 2]
  const float* bias;  // [N] or null
  uint16_t* out;      // [M, N]
  int64_t N, K;
};

// out[r, panel's outputs] = partial[r] (+ bias), rounded to nearest even, for rows [r0, r1);
// outputs past N (the last panel's padding) are not written.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void store_panel(const AmxArgs& a, const float* partial, int64_t panel, int64_t r0, int64_t r1) {
  for (int64_t b = 0; b < kPanelRows / 16; ++b) {
    const int64_t n = panel * kPanelRows + b * 16;
    if (n >= a.N) break;
    const __mmask16 mask = a.N - n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (a.N - n)) - 1);
    const __m512 bv = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n) : _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; ++r) {
      const __m512 y = _mm512_add_ps(_mm512_loadu_ps(partial + (r - r0) * kPanelRows + b * 16), bv);
      _mm256_mask_storeu_epi16(a.out + r * a.N + n, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

// Work units are whole panels: each thread streams its panels front to back.
void amx_matmul(const AmxArgs& a, int64_t M) {
  const int64_t kp = a.K / 2, panels = (a.N + kPanelRows - 1) / kPanelRows;
  const int64_t chunk_pairs = M <= kTileRows ? kChunkPairsOneTile : kChunkPairsManyRows;
  for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
    const int64_t c1 = std::min(M, c0 + kChunkRows);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      alignas(64) static thread_local float partial[kChunkRows * kPanelRows];  // [rows, 64] sums
      int64_t configured = 0;  // rows of the current tile configuration; 0: none
      for (int64_t panel = begin; panel < end; ++panel) {
        for (int64_t k0 = 0; k0 < kp; k0 += chunk_pairs) {
          const int64_t k1 = std::min(kp, k0 + chunk_pairs);
          for (int64_t m0 = c0; m0 < c1; m0 += kTileRows) {
            const int64_t rows = std::min(kTileRows, c1 - m0);
            if (rows != configured) {
              configure_tiles(rows);
              configured = rows;
            }
            tile_step(a.x + m0 * a.K + 2 * k0, a.K * 2, a.w + (panel * kp + k0) * 2 * kPanelRows, k1 - k0,
                      partial + (m0 - c0) * kPanelRows, k0 == 0);
          }
        }
        store_panel(a, partial, panel, c0, c1);
      }
      if (configured) release_tiles();
    });
  }
}

// The 4-bit panels and their values: cpu_int4.h.
using srt_lite_int4::group_sums;
using srt_lite_int4::kGroupCodeBytes;
using srt_lite_int4::kGroupPairs;
constexpr int64_t kTileBytes = kTilePairs * 64;  // one bf16 B tile
static_assert(kTileBytes / 2 == srt_lite_int4::kGroupVector, "a group's values of one vector are one B tile");

// acc [rows, 64] += scale * c + zero * xsum[r] for one group (c: its [rows, 64] tile sums).
__attribute__((target("avx512f")))
void scale_group(const float* c, const float* scale, const float* zero, const float* xsum, int64_t xsum_ld, int64_t rows,
                 float* acc, bool first) {
  __m512 s[4], z[4];
  for (int b = 0; b < 4; ++b) {
    s[b] = _mm512_loadu_ps(scale + b * 16);
    z[b] = _mm512_loadu_ps(zero + b * 16);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 xs = _mm512_set1_ps(xsum[r * xsum_ld]);
    for (int b = 0; b < 4; ++b) {
      float* o = acc + r * kPanelRows + b * 16;
      const __m512 base = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
      _mm512_storeu_ps(o, _mm512_fmadd_ps(xs, z[b], _mm512_fmadd_ps(_mm512_loadu_ps(c + r * kPanelRows + b * 16), s[b], base)));
    }
  }
}

// c [rows, 64] fp32 = x [rows, 32] (ldx_bytes apart) . tiles (one group's q - 8).
__attribute__((target("amx-tile,amx-bf16")))
void group_product(const uint16_t* x, int64_t ldx_bytes, const uint16_t* tiles, float* c) {
  constexpr int64_t ldc_bytes = kPanelRows * sizeof(float);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, x, ldx_bytes);
  _tile_loadd(5, tiles, 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, tiles + kTileBytes / 2, 64);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(7, tiles + kTileBytes, 64);
  _tile_dpbf16ps(2, 4, 7);
  _tile_loadd(5, tiles + 3 * kTileBytes / 2, 64);
  _tile_dpbf16ps(3, 4, 5);
  _tile_stored(0, c, ldc_bytes);
  _tile_stored(1, c + 16, ldc_bytes);
  _tile_stored(2, c + 32, ldc_bytes);
  _tile_stored(3, c + 48, ldc_bytes);
}

struct AmxInt4Args {
  const uint16_t* x;     // [M, K]
  const uint8_t* codes;  // [N / 64, K / 4, 4, 32]
  const float* sz;       // [N / 64, K / 32, 2, 64]
  const float* xsum;     // [M, K / 32]
  AmxArgs out;           // bias, out, N, K (its x and w unused)
};

// A group's tile sums waiting to be scaled into acc (scale_group's arguments).
struct PendingScale {
  const float* c = nullptr;
  const float* scale;
  const float* xsum;
  int64_t xsum_ld, rows;
  float* acc;
  bool first;
};

inline void flush(PendingScale& p) {
  if (p.c) scale_group(p.c, p.scale, p.scale + kPanelRows, p.xsum, p.xsum_ld, p.rows, p.acc, p.first);
  p.c = nullptr;
}

// Work units are whole panels; each group's q - 8 tiles serve every tile of rows of a chunk.
// A product's sums are scaled one product later, from the other of two buffers: reading
// them straight after the tiles store them would wait on the tile unit.
void amx_int4_matmul(const AmxInt4Args& a, int64_t M) {
  const int64_t K = a.out.K, groups = K / (2 * kGroupPairs), panels = (a.out.N + kPanelRows - 1) / kPanelRows;
  for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
    const int64_t c1 = std::min(M, c0 + kChunkRows);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      alignas(64) static thread_local float acc[kChunkRows * kPanelRows];   // [rows, 64] sums
      alignas(64) static thread_local float c[2][kTileRows * kPanelRows];   // [16, 64] a product's sums, twice
      alignas(64) static thread_local uint16_t tiles[4 * kTileBytes / 2];   // [4, 16, 32] bf16 q - 8
      int64_t configured = 0;
      int flip = 0;
      PendingScale pending;
      for (int64_t panel = begin; panel < end; ++panel) {
        for (int64_t g = 0; g < groups; ++g) {
          srt_lite_int4::group_values(a.codes + (panel * groups + g) * kGroupCodeBytes, tiles, 0, 4);
          const float* scale = a.sz + (panel * groups + g) * 2 * kPanelRows;
          for (int64_t m0 = c0; m0 < c1; m0 += kTileRows) {
            const int64_t rows = std::min(kTileRows, c1 - m0);
            if (rows != configured) {
              configure_tiles(rows);
              configured = rows;
            }
            float* sums = c[flip];
            flip ^= 1;
            group_product(a.x + m0 * K + g * 32, K * 2, tiles, sums);
            flush(pending);
            pending = PendingScale{sums, scale, a.xsum + m0 * groups + g, groups, rows, acc + (m0 - c0) * kPanelRows, g == 0};
          }
        }
        flush(pending);
        store_panel(a.out, acc, panel, c0, c1);
      }
      if (configured) release_tiles();
    });
  }
}
#endif

// Whether this build and CPU run the op, and Linux lets the process use the tiles.
bool amx_supported() { return srt_lite_amx::supported(); }

// x [M, K] bf16 with K a multiple of 32, weight [N / 64, K / 2, 64, 2] bf16 (pack_panels in
// linear.py), bias [N] or none -> [M, N] bf16; fp32 accumulation.
at::Tensor amx_panel_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            int64_t N) {
  TORCH_CHECK(amx_supported(), "amx_panel_linear: this CPU (or build, or OS) has no AMX-BF16");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 4 && weight.is_contiguous() &&
                  weight.size(2) == kPanelRows && weight.size(3) == 2,
              "amx_panel_linear: weight must be a contiguous bf16 [N / 64, K / 2, 64, 2]");
  const int64_t K = 2 * weight.size(1);
  TORCH_CHECK(K % (2 * kTilePairs) == 0, "amx_panel_linear: K = ", K, " is not a multiple of ", 2 * kTilePairs);
  TORCH_CHECK(N > (weight.size(0) - 1) * kPanelRows && N <= weight.size(0) * kPanelRows, "amx_panel_linear: N = ", N,
              " does not fit ", weight.size(0), " panels");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == K,
              "amx_panel_linear: x must be bf16 [M, ", K, "]");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == N, "amx_panel_linear: bias must be [N]");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());  // [M, N]
#ifdef SRT_LITE_HAVE_AMX
  if (M == 0) return out;
  at::Tensor xc = x.contiguous();
  at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();  // [N] fp32
  amx_matmul(AmxArgs{reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()),
                     reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>()),
                     has_bias ? bf.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()),
                     N, K},
             M);
#endif
  return out;
}

// x [M, K] bf16, codes [N / 64, K / 4, 4, 32] uint8 and sz [N / 64, K / 32, 2, 64] fp32
// (pack_int4_panels in linear.py), bias [N] or none -> [M, N] bf16; fp32 accumulation.
at::Tensor amx_int4_panel_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                                 const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(amx_supported(), "amx_int4_panel_linear: this CPU (or build, or OS) has no AMX-BF16");
  const int64_t K = check_int4_panel_args("amx_int4_panel_linear", x, codes, sz, bias, N);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());  // [M, N]
#ifdef SRT_LITE_HAVE_AMX
  if (M == 0) return out;
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  at::Tensor xsum = at::empty({M, K / (2 * kTilePairs)}, x.options().dtype(at::kFloat));  // [M, K / 32]
  group_sums(xp, M, K, xsum.data_ptr<float>());
  at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();  // [N] fp32
  const AmxArgs o{nullptr, nullptr, has_bias ? bf.data_ptr<float>() : nullptr,
                  reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), N, K};
  amx_int4_matmul(AmxInt4Args{xp, codes.data_ptr<uint8_t>(), sz.data_ptr<float>(), xsum.data_ptr<float>(), o}, M);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def("amx_panel_linear(Tensor x, Tensor weight, Tensor? bias, int N) -> Tensor");
  m.def("amx_int4_panel_linear(Tensor x, Tensor codes, Tensor sz, Tensor? bias, int N) -> Tensor");
  m.def("amx_supported() -> bool");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) {
  m.impl("amx_panel_linear", &amx_panel_linear);
  m.impl("amx_int4_panel_linear", &amx_int4_panel_linear);
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CompositeExplicitAutograd, m) { m.impl("amx_supported", &amx_supported); }
