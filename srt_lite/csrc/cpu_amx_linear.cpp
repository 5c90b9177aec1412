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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__linux__)
#define SRT_LITE_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

// Linux hands a process AMX's tile data only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); a tile instruction before that raises SIGILL.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool cpu_has_amx_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (edx >> 22 & 1) && (edx >> 24 & 1);  // AMX-BF16, AMX-TILE
}

// The 64-byte tile configuration of palette 1 (Intel SDM, LDTILECFG).
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes a row, per tile
  uint8_t rows[16] = {};    // rows, per tile
};

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
  // Inline asm with a memory operand: GCC does not see _tile_loadconfig read cfg and drops
  // the stores that fill it.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

__attribute__((target("amx-tile")))
void release_tiles() { _tile_release(); }

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
      // Released tiles are not saved and restored on every context switch.
      if (configured) release_tiles();
    });
  }
}
#endif

// Whether this build and CPU run the op, and Linux lets the process use the tiles.
bool amx_supported() {
#ifdef SRT_LITE_HAVE_AMX
  static const bool ok = cpu_has_amx_bf16() && __builtin_cpu_supports("avx512bf16") &&
                         syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
#else
  return false;
#endif
}

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def("amx_panel_linear(Tensor x, Tensor weight, Tensor? bias, int N) -> Tensor");
  m.def("amx_supported() -> bool");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) { m.impl("amx_panel_linear", &amx_panel_linear); }

TORCH_LIBRARY_IMPL(srt_lite_cpu, CompositeExplicitAutograd, m) { m.impl("amx_supported", &amx_supported); }
