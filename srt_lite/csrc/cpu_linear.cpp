// bf16 weights on CPUs where oneDNN refuses bf16 (AVX2 without AVX-NE-CONVERT, and others).
//
// There torch's bf16 matmul falls back to a reference loop that is ~10x slower than fp32
// beyond one row, yet bf16 weights are worth keeping: decode reads every weight once per
// step, and bf16 halves those bytes. This op keeps the weights in bf16 and computes in fp32
// (accumulation in fp32, as oneDNN's bf16 path does):
// - few rows (decode, verify): each thread widens a block of weight rows to fp32 in a small
//   scratch that stays in cache and runs an at::vec micro-kernel over all input rows, so the
//   weight is read from memory once, at 2 bytes an element;
// - many rows (prefill): chunks of the weight are widened into an fp32 buffer and the fp32
//   matmul runs on them; the widening is small next to the product's arithmetic.
// Where oneDNN does take the weights, packed_linear is the compiled graph's way to its
// packed product (oneDNN's own layout, packed once by PackableLinear.pack_for_cpu).
// Built with the other sources into one extension by srt_lite/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// Weight rows widened together by the micro-kernel, and input rows it takes at once: 4 x 2
// accumulators plus the loaded vectors fit the 16 registers of AVX2.
constexpr int64_t kWRows = 4;
constexpr int64_t kXRows = 2;

// dst[i] = float(src[i]); a bf16 is the high half of a float, so this is a shift that the
// compiler vectorises for the target's flags.
inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    d[i] = static_cast<uint32_t>(s[i]) << 16;
  }
}

// tile[m, j] = dot(x[m], w[j]) for m < XR, j < WR. The weight rows are read as bf16 and
// widened in registers: at a few input rows the product is bound by reading the weight, and
// a widened copy in memory would cost a store and a load more. XR and WR are template
// arguments so that the accumulators stay in registers (loops with run-time bounds spill).
template <int64_t XR, int64_t WR>
void micro_kernel(const float* x, const c10::BFloat16* w, int64_t K, float* tile) {
  constexpr int64_t step = 2 * Vec::size();  // bf16 elements widened into two float vectors
  Vec acc[XR][WR];
  for (int64_t m = 0; m < XR; ++m) {
    for (int64_t j = 0; j < WR; ++j) acc[m][j] = Vec(0.0f);
  }
  const int64_t kv = K - K % step;
  for (int64_t k = 0; k < kv; k += step) {
    Vec lo[WR], hi[WR];
    for (int64_t j = 0; j < WR; ++j) at::vec::load_to_float<c10::BFloat16>(w + j * K + k, lo[j], hi[j]);
    for (int64_t m = 0; m < XR; ++m) {
      const Vec xl = Vec::loadu(x + m * K + k), xh = Vec::loadu(x + m * K + k + Vec::size());
      for (int64_t j = 0; j < WR; ++j) acc[m][j] = at::vec::fmadd(xh, hi[j], at::vec::fmadd(xl, lo[j], acc[m][j]));
    }
  }
  float lanes[Vec::size()];
  for (int64_t m = 0; m < XR; ++m) {
    for (int64_t j = 0; j < WR; ++j) {
      acc[m][j].store(lanes);
      float sum = 0.0f;
      for (int64_t l = 0; l < Vec::size(); ++l) sum += lanes[l];
      for (int64_t k = kv; k < K; ++k) sum += x[m * K + k] * static_cast<float>(w[j * K + k]);
      tile[m * kWRows + j] = sum;
    }
  }
}

// micro_kernel for xr <= kXRows input rows and wr <= kWRows weight rows (the edges of M and N).
void micro_kernel_any(const float* x, const c10::BFloat16* w, int64_t K, int64_t xr, int64_t wr, float* tile) {
  if (wr == kWRows) {
    if (xr == 2) return micro_kernel<2, kWRows>(x, w, K, tile);
    return micro_kernel<1, kWRows>(x, w, K, tile);
  }
  for (int64_t m = 0; m < xr; ++m) {
    for (int64_t j = 0; j < wr; ++j) micro_kernel<1, 1>(x + m * K, w + j * K, K, tile + m * kWRows + j);
  }
}

// out [M, N] = x [M, K] fp32 . W^T (+ bias), W bf16 [N, K], written in out's dtype T; one
// block of kWRows weight rows per task.
template <typename T>
void few_rows(const float* x, const c10::BFloat16* w, const float* bias, T* out, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = (N + kWRows - 1) / kWRows;
  // Grain: enough blocks per task that a task's set-up is small next to its work.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float tile[kXRows * kWRows];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kWRows, wr = std::min(kWRows, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kXRows) {
        const int64_t xr = std::min(kXRows, M - m0);
        micro_kernel_any(x + m0 * K, w + n0 * K, K, xr, wr, tile);
        for (int64_t m = 0; m < xr; ++m) {
          for (int64_t j = 0; j < wr; ++j) {
            out[(m0 + m) * N + n0 + j] = static_cast<T>(tile[m * kWRows + j] + (bias ? bias[n0 + j] : 0.0f));
          }
        }
      }
    }
  });
}

// Floats of weight widened at once for a many-row product: bounds the fp32 copy (a large
// vocabulary's LM head would otherwise need a gigabyte) while each chunk's matmul stays large.
constexpr int64_t kWideFloats = 1024 * 1024;

// out [M, N] fp32 = x [M, K] fp32 . W^T through fp32 copies of chunks of W's rows. Each chunk
// fills a block of rows of out^T [N, M], contiguous, so the matmul writes it in place.
at::Tensor many_rows(const at::Tensor& xf, const at::Tensor& weight) {
  const int64_t M = xf.size(0), N = weight.size(0), K = weight.size(1);
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(N, kWideFloats / std::max<int64_t>(K, 1)));
  at::Tensor wide = at::empty({rows, K}, weight.options().dtype(at::kFloat));  // [rows, K]
  at::Tensor out_t = at::empty({N, M}, xf.options());  // [N, M]
  const auto* w = weight.data_ptr<c10::BFloat16>();
  float* wp = wide.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t nb = std::min(rows, N - n0);
    at::parallel_for(0, nb, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
      widen(w + (n0 + begin) * K, wp + begin * K, (end - begin) * K);
    });
    at::Tensor dst = out_t.narrow(0, n0, nb);
    at::mm_out(dst, wide.narrow(0, 0, nb), xf.t());
  }
  return out_t.t();  // [M, N], a transposed view
}

// x [M, K] (bf16 or fp32), weight [N, K] bf16, bias [N] or none -> [M, N] in x's dtype.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       int64_t few_rows_max) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "bf16_linear: weight must be a contiguous bf16 [N, K]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1), "bf16_linear: x must be [M, K] with K = ", weight.size(1));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "bf16_linear: x must be bf16 or fp32");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == weight.size(0), "bf16_linear: bias must be [N]");
  const int64_t M = x.size(0), K = weight.size(1), N = weight.size(0);
  if (M > few_rows_max) {
    at::Tensor out = many_rows(x.to(at::kFloat).contiguous(), weight);  // [M, N] view of [N, M]
    if (has_bias) out.add_(bias->to(at::kFloat));
    return at::empty({M, N}, x.options()).copy_(out);  // [M, N] contiguous, in x's dtype
  }
  // Few rows: no tensor temporaries (their set-up is a large share of a small product's time).
  thread_local std::vector<float> xf, bf;
  xf.resize(M * K);  // [M, K]
  at::Tensor xc = x.contiguous();
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(xf.data(), xc.data_ptr<float>(), M * K * sizeof(float));
  } else {
    widen(xc.data_ptr<c10::BFloat16>(), xf.data(), M * K);
  }
  const float* bp = nullptr;
  if (has_bias) {
    at::Tensor b = bias->to(at::kFloat).contiguous();
    bf.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
    bp = bf.data();
  }
  at::Tensor out = at::empty({M, N}, x.options());  // [M, N]
  const auto* w = weight.data_ptr<c10::BFloat16>();
  if (x.scalar_type() == at::kFloat) {
    few_rows(xf.data(), w, bp, out.data_ptr<float>(), M, N, K);
  } else {
    few_rows(xf.data(), w, bp, out.data_ptr<c10::BFloat16>(), M, N, K);
  }
  return out;
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
#define SRT_LITE_HAVE_BF16_DOT 1
// out[j] = dot(x, w[j]) for WR weight rows, in AVX512-BF16 dot products (vdpbf16ps: pairs of
// bf16 products summed into fp32 lanes), U vectors of K in flight per row. Built for that
// target alone; called only where the CPU has the instructions (the caller checks).
template <int WR, int U>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void bf16_dot_rows(const uint16_t* x, const uint16_t* w, int64_t K, float* out) {
  __m512 acc[WR][U];
  for (int j = 0; j < WR; ++j) {
    for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 32 * U <= K; k += 32 * U) {
    for (int u = 0; u < U; ++u) {
      const __m512i xv = _mm512_loadu_si512(x + k + 32 * u);
      for (int j = 0; j < WR; ++j) {
        acc[j][u] = _mm512_dpbf16_ps(acc[j][u], (__m512bh)xv, (__m512bh)_mm512_loadu_si512(w + j * K + k + 32 * u));
      }
    }
  }
  for (; k < K; k += 32) {  // the tail, masked: zeros add nothing
    const __mmask32 mask = K - k >= 32 ? static_cast<__mmask32>(0xffffffffu) : static_cast<__mmask32>((1ull << (K - k)) - 1);
    const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + k);
    for (int j = 0; j < WR; ++j) {
      acc[j][0] = _mm512_dpbf16_ps(acc[j][0], (__m512bh)xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * K + k));
    }
  }
  for (int j = 0; j < WR; ++j) {
    __m512 sum = acc[j][0];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[j][u]);
    out[j] = _mm512_reduce_add_ps(sum);
  }
}

// y [N] = W [N, K] . x [K], blocks of WR rows per step.
template <int WR, int U>
void bf16_gemv_rows(const uint16_t* x, const uint16_t* w, float* y, int64_t N, int64_t K) {
  const int64_t blocks = N / WR;
  at::parallel_for(0, blocks, std::max<int64_t>(1, 16384 / (WR * K)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) bf16_dot_rows<WR, U>(x, w + b * WR * K, K, y + b * WR);
  });
  for (int64_t n = blocks * WR; n < N; ++n) bf16_dot_rows<1, 1>(x, w + n * K, K, y + n);
}
#endif

bool bf16_dot_supported() {
#ifdef SRT_LITE_HAVE_BF16_DOT
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// x [1, K] bf16, weight [N, K] bf16 -> [1, N] bf16: one token's product, bound by reading the
// weight. Each thread streams its share of rows front to back; a row at a time (eight
// vectors in flight) reads fastest while x stays in L1 (K up to 4096), and blocks of eight
// rows beyond, where one pass of x per row would be evicted by the weight's stream.
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(bf16_dot_supported(), "bf16_gemv: this CPU (or build) has no AVX512-BF16");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "bf16_gemv: weight must be a contiguous bf16 [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) == 1 && x.size(1) == weight.size(1),
              "bf16_gemv: x must be bf16 [1, K] with K = ", weight.size(1));
  const int64_t N = weight.size(0), K = weight.size(1);
  at::Tensor out = at::empty({1, N}, x.options());  // [1, N]
#ifdef SRT_LITE_HAVE_BF16_DOT
  at::Tensor xc = x.contiguous();
  thread_local std::vector<float> y;
  y.resize(N);  // [N] fp32 sums, rounded once into out
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  if (K <= 4096) {
    bf16_gemv_rows<1, 8>(xp, wp, y.data(), N, K);
  } else {
    bf16_gemv_rows<8, 1>(xp, wp, y.data(), N, K);
  }
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  for (int64_t n = 0; n < N; ++n) op[n] = static_cast<c10::BFloat16>(y[n]);
#endif
  return out;
}


// Panel layout (srt_lite's own prepacked bf16 weight, see panel_linear): weight [N, K] as
// [N / 64, K / 2, 64, 2], zero padded, so one k pair of 64 outputs is four 512-bit vectors
// in a row. `vdpbf16ps` with the pair of x broadcast then adds both products into each
// output's fp32 lane: no horizontal sums, and each weight vector serves every x row of a tile.
constexpr int64_t kPanelRows = 64;

// Set by srt_lite_cpu::set_batch_invariant: every row of a product then sums k in the same
// order, whatever the row count (layers/batch_invariant.py).
bool g_batch_invariant = false;
void set_batch_invariant(bool on) { g_batch_invariant = on; }

#ifdef SRT_LITE_HAVE_BF16_DOT
// acc[m][b] += x[m] . w's 16-output vector b over k pairs [0, kp), for MR x rows (ldx
// elements apart) and NB vectors of the panel starting at `w` (one k pair is 64 x 2 bf16).
// U > 1 (one row only) keeps U accumulator chains per vector, so a one-token product is not
// bound by the dot product's latency.
constexpr int64_t kPrefetchPairs = 16;
template <int MR, int NB, int U>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void panel_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t kp, __m512 (&io)[MR][NB]) {
  __m512 acc[U][MR][NB];
  for (int u = 0; u < U; ++u) {
    for (int m = 0; m < MR; ++m) {
      for (int b = 0; b < NB; ++b) acc[u][m][b] = u == 0 ? io[m][b] : _mm512_setzero_ps();
    }
  }
  int64_t p = 0;
  for (; p + U <= kp; p += U) {
    for (int u = 0; u < U; ++u) {
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (p + u + kPrefetchPairs) * 2 * kPanelRows + b * 32), _MM_HINT_T0);
        wv[b] = _mm512_loadu_si512(w + (p + u) * 2 * kPanelRows + b * 32);
      }
      for (int m = 0; m < MR; ++m) {
        uint32_t pair;
        std::memcpy(&pair, x + m * ldx + 2 * (p + u), sizeof(pair));
        const __m512i xb = _mm512_set1_epi32(static_cast<int>(pair));
        for (int b = 0; b < NB; ++b) acc[u][m][b] = _mm512_dpbf16_ps(acc[u][m][b], (__m512bh)xb, (__m512bh)wv[b]);
      }
    }
  }
  for (; p < kp; ++p) {  // U > 1 only: the pairs left over
    for (int b = 0; b < NB; ++b) {
      const __m512i wv = _mm512_loadu_si512(w + p * 2 * kPanelRows + b * 32);
      uint32_t pair;
      std::memcpy(&pair, x + 2 * p, sizeof(pair));
      acc[0][0][b] = _mm512_dpbf16_ps(acc[0][0][b], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), (__m512bh)wv);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int b = 0; b < NB; ++b) {
      __m512 sum = acc[0][m][b];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][m][b]);
      io[m][b] = sum;
    }
  }
}

struct PanelArgs {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [N / 64, K / 2, 64, 2]
  const float* bias;  // [N] or null
  uint16_t* out;      // [M, N]
  int64_t N, K, kp;
};

// Rows [m0, m0 + MR) against NB vectors of a panel (from vector b0), over k pairs [k0, k1).
// A partial range keeps its sums in `partial` (fp32 [MR, 64]); the last one writes out, with
// the bias, rounded to nearest even; outputs past N (the panel's padding) are not written.
template <int MR, int NB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void panel_step(const PanelArgs& a, int64_t m0, int64_t panel, int64_t b0, int64_t k0, int64_t k1, float* partial) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m) {
    for (int b = 0; b < NB; ++b) acc[m][b] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + m * kPanelRows + b * 16);
  }
  const uint16_t* x = a.x + m0 * a.K + 2 * k0;
  const uint16_t* w = a.w + (panel * a.kp + k0) * 2 * kPanelRows + b0 * 32;
  if constexpr (MR == 1) {
    // Two chains per vector hide the dot product's latency for one row, but sum k in
    // another order than a row inside a tile: batch-invariant runs keep one chain.
    if (!g_batch_invariant) {
      panel_tile<MR, NB, 2>(x, a.K, w, k1 - k0, acc);
    } else {
      panel_tile<MR, NB, 1>(x, a.K, w, k1 - k0, acc);
    }
  } else {
    panel_tile<MR, NB, 1>(x, a.K, w, k1 - k0, acc);
  }
  if (k1 < a.kp) {
    for (int m = 0; m < MR; ++m) {
      for (int b = 0; b < NB; ++b) _mm512_storeu_ps(partial + m * kPanelRows + b * 16, acc[m][b]);
    }
    return;
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n = panel * kPanelRows + (b0 + b) * 16;
    if (n >= a.N) break;
    const __mmask16 mask = a.N - n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (a.N - n)) - 1);
    const __m512 bv = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][b], bv));
      _mm256_mask_storeu_epi16(a.out + (m0 + m) * a.N + n, mask, y);
    }
  }
}

// panel_step for a tile of `rows` rows: up to 6 against a whole panel (NB = 4), up to 8
// against half of one (NB = 2): 24 or 16 accumulators, with the weight vectors and the x
// broadcast still in the 32 vector registers (8 x 4 would spill).
template <int NB>
void panel_rows(int64_t rows, const PanelArgs& a, int64_t m0, int64_t panel, int64_t b0, int64_t k0, int64_t k1,
                float* partial) {
  switch (rows) {
    case 1: return panel_step<1, NB>(a, m0, panel, b0, k0, k1, partial);
    case 2: return panel_step<2, NB>(a, m0, panel, b0, k0, k1, partial);
    case 3: return panel_step<3, NB>(a, m0, panel, b0, k0, k1, partial);
    case 4: return panel_step<4, NB>(a, m0, panel, b0, k0, k1, partial);
    case 5: return panel_step<5, NB>(a, m0, panel, b0, k0, k1, partial);
    case 6: return panel_step<6, NB>(a, m0, panel, b0, k0, k1, partial);
  }
  if constexpr (NB == 2) {
    switch (rows) {
      case 7: return panel_step<7, NB>(a, m0, panel, b0, k0, k1, partial);
      case 8: return panel_step<8, NB>(a, m0, panel, b0, k0, k1, partial);
    }
  }
  TORCH_CHECK(false, "panel_rows: no tile of ", rows, " rows");
}

// Rows a tile takes against NB vectors.
constexpr int64_t tile_rows(int NB) { return NB == 2 ? 8 : 6; }

// Rows of x taken per pass over the weight: their x stays in the core's L2 while every panel
// streams past it.
constexpr int64_t kPanelChunkRows = 128;
// k pairs of a panel taken per pass over a chunk's rows: 1024 pairs of 64 outputs are 256 KB,
// which stay in L2 while each tile of rows reads them (a whole panel of a K = 8192 weight
// would not, and every tile would read it from memory again).
constexpr int64_t kPanelChunkPairs = 1024;

// out [M, N] = x [M, K] . W^T (+ bias) over the panel-packed W. Work units are whole panels
// (NB = 4), or half panels (NB = 2) when there are too few panels to share between threads
// (half panels read a strided half of each panel: slower where the weight streams from
// memory, so large weights keep whole ones).
template <int NB>
void panel_matmul(const PanelArgs& a, int64_t M) {
  const int64_t panels = (a.N + kPanelRows - 1) / kPanelRows, parts = 4 / NB, units = panels * parts;
  constexpr int64_t tile = tile_rows(NB);
  for (int64_t c0 = 0; c0 < M; c0 += kPanelChunkRows) {
    const int64_t c1 = std::min(M, c0 + kPanelChunkRows);
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> partial;
      partial.resize(kPanelChunkRows * kPanelRows);  // [rows, 64] sums of a k range
      for (int64_t u = begin; u < end; ++u) {
        const int64_t panel = u / parts, b0 = (u % parts) * NB;
        for (int64_t k0 = 0; k0 < a.kp; k0 += kPanelChunkPairs) {
          const int64_t k1 = std::min(a.kp, k0 + kPanelChunkPairs);
          for (int64_t m0 = c0; m0 < c1; m0 += tile) {
            panel_rows<NB>(std::min(tile, c1 - m0), a, m0, panel, b0, k0, k1, partial.data() + (m0 - c0) * kPanelRows);
          }
        }
      }
    });
  }
}
#endif

// x [M, K] bf16, weight [N / 64, K / 2, 64, 2] bf16 (pack_panels in linear.py), bias [N] or
// none -> [M, N] bf16; fp32 accumulation.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(bf16_dot_supported(), "panel_linear: this CPU (or build) has no AVX512-BF16");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 4 && weight.is_contiguous() &&
                  weight.size(2) == kPanelRows && weight.size(3) == 2,
              "panel_linear: weight must be a contiguous bf16 [N / 64, K / 2, 64, 2]");
  const int64_t K = 2 * weight.size(1);
  TORCH_CHECK(N > (weight.size(0) - 1) * kPanelRows && N <= weight.size(0) * kPanelRows, "panel_linear: N = ", N,
              " does not fit ", weight.size(0), " panels");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == K, "panel_linear: x must be bf16 [M, ", K, "]");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == N, "panel_linear: bias must be [N]");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());  // [M, N]
#ifdef SRT_LITE_HAVE_BF16_DOT
  if (M == 0) return out;
  at::Tensor xc = x.contiguous();
  at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();  // [N] fp32
  const PanelArgs args{
      reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()),
      reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>()), has_bias ? bf.data_ptr<float>() : nullptr,
      reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), N, K, K / 2};
  if (weight.size(0) < 8 * at::get_num_threads()) {
    panel_matmul<2>(args, M);
  } else {
    panel_matmul<4>(args, M);
  }
#endif
  return out;
}

// fp32 panel layout (srt_lite's own prepacked fp32 weight, see f32_panel_linear): weight
// [N, K] as [N / 32, K, 32, 1], zero padded, so one k of 32 outputs is two AVX-512 vectors
// (four AVX2 ones) in a row, and each thread streams whole panels. MKL's sgemv/sgemm read a
// plain weight far below the memory's speed at decode's few rows; this reads it once for a
// tile of rows at a time.
// Every output sums its k terms in order in one fused multiply-add chain, whatever the tile
// or the number of rows, so a row's result does not depend on the batch it is computed in.
constexpr int64_t kF32PanelRows = 32;
constexpr int kF32Vecs = static_cast<int>(kF32PanelRows / Vec::size());
// Rows a tile takes: kF32Vecs accumulators a row, with the weight vectors and a broadcast,
// in the vector registers (32 with AVX-512, 16 with AVX2).
constexpr int kF32TileRows = Vec::size() >= 16 ? 12 : 3;
// Rows of x taken per pass over the weight, and k taken per pass over those rows: a panel's
// 512 k are 64 KB, which stay in L2 while each tile of the chunk reads them.
constexpr int64_t kF32ChunkRows = 96;
constexpr int64_t kF32ChunkK = 512;
// How far ahead (in k) the weight stream is prefetched.
constexpr int64_t kF32PrefetchK = 16;

template <typename TW>
struct F32PanelArgs {
  const float* x;     // [M, K]
  const TW* w;        // [N / 32, K, 32, 1], fp32 or bf16 (widened to fp32 as it is read)
  const float* bias;  // [N] or null
  float* out;         // [M, N]
  int64_t N, K;
};

// Rows [m0, m0 + MR) against a panel over k [k0, k1). A partial range keeps its sums in
// `partial` (fp32 [MR, 32]); the last one writes out, with the bias; outputs past N (the
// panel's padding) are not written.
inline Vec load_weight(const float* p) { return Vec::loadu(p); }
inline Vec load_weight(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_to_float<c10::BFloat16>(p, v);
  return v;
}

template <int MR, typename TW>
void f32_panel_step(const F32PanelArgs<TW>& a, const TW* wp, int64_t m0, int64_t panel, int64_t k0, int64_t k1,
                    float* partial) {
  constexpr int64_t W = Vec::size();
  Vec acc[MR][kF32Vecs];
  for (int m = 0; m < MR; ++m) {
    for (int b = 0; b < kF32Vecs; ++b) acc[m][b] = k0 == 0 ? Vec(0.f) : Vec::loadu(partial + m * kF32PanelRows + b * W);
  }
  const TW* w = wp + k0 * kF32PanelRows;
  const float* x = a.x + m0 * a.K;
  for (int64_t k = k0; k < k1; ++k, w += kF32PanelRows) {
    for (int64_t line = 0; line < kF32PanelRows * static_cast<int64_t>(sizeof(TW)); line += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(w + kF32PrefetchK * kF32PanelRows) + line);
    }
    Vec wv[kF32Vecs];
    for (int b = 0; b < kF32Vecs; ++b) wv[b] = load_weight(w + b * W);
    for (int m = 0; m < MR; ++m) {
      const Vec xb(x[m * a.K + k]);
      for (int b = 0; b < kF32Vecs; ++b) acc[m][b] = at::vec::fmadd(xb, wv[b], acc[m][b]);
    }
  }
  if (k1 < a.K) {
    for (int m = 0; m < MR; ++m) {
      for (int b = 0; b < kF32Vecs; ++b) acc[m][b].store(partial + m * kF32PanelRows + b * W);
    }
    return;
  }
  for (int b = 0; b < kF32Vecs; ++b) {
    const int64_t n = panel * kF32PanelRows + b * W;
    if (n >= a.N) break;
    const int count = static_cast<int>(std::min(W, a.N - n));
    const Vec bv = a.bias ? Vec::loadu(a.bias + n, count) : Vec(0.f);
    for (int m = 0; m < MR; ++m) (acc[m][b] + bv).store(a.out + (m0 + m) * a.N + n, count);
  }
}

// f32_panel_step for a tile of 1..MR rows; wp: the panel's weight at k = 0 (a.w's panel, or
// an fp32 copy of it), panel: which outputs it computes.
template <int MR = kF32TileRows, typename TW>
void f32_panel_rows(int64_t rows, const F32PanelArgs<TW>& a, const TW* wp, int64_t m0, int64_t panel, int64_t k0,
                    int64_t k1, float* partial) {
  if constexpr (MR > 1) {
    if (rows < MR) return f32_panel_rows<MR - 1>(rows, a, wp, m0, panel, k0, k1, partial);
  }
  f32_panel_step<MR>(a, wp, m0, panel, k0, k1, partial);
}

// out [M, N] = x . W^T (+ bias) over the panels, work units whole panels split between threads.
// bf16 weights read by more than kWidenTiles tiles of rows are widened once per k range into
// an fp32 copy of it that the tiles then read: widening in every tile cost more than the
// bytes it saves once a chunk has many tiles (AVX2's tiles are 3 rows), and the copy's extra
// pass cost more than it saved for a few. Widening is exact, so the sums are the same either way.
constexpr int64_t kWidenTiles = 4;
template <typename TW>
void f32_panel_matmul(const F32PanelArgs<TW>& a, int64_t M, int64_t panels) {
  for (int64_t c0 = 0; c0 < M; c0 += kF32ChunkRows) {
    const int64_t c1 = std::min(M, c0 + kF32ChunkRows);
    const bool widen = !std::is_same_v<TW, float> && c1 - c0 > kWidenTiles * kF32TileRows;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> partial, wide;
      partial.resize(kF32ChunkRows * kF32PanelRows);  // [rows, 32] sums of a k range
      if (widen) wide.resize(kF32ChunkK * kF32PanelRows);  // [k, 32] one panel's k range in fp32
      for (int64_t panel = begin; panel < end; ++panel) {
        for (int64_t k0 = 0; k0 < a.K; k0 += kF32ChunkK) {
          const int64_t k1 = std::min(a.K, k0 + kF32ChunkK);
          if (widen) {
            const TW* src = a.w + (panel * a.K + k0) * kF32PanelRows;
            for (int64_t i = 0; i < (k1 - k0) * kF32PanelRows; i += Vec::size()) load_weight(src + i).store(wide.data() + i);
            const F32PanelArgs<float> f{a.x, nullptr, a.bias, a.out, a.N, a.K};
            const float* wp = wide.data() - k0 * kF32PanelRows;  // the copy, indexed from k = 0
            for (int64_t m0 = c0; m0 < c1; m0 += kF32TileRows) {
              f32_panel_rows(std::min<int64_t>(kF32TileRows, c1 - m0), f, wp, m0, panel, k0, k1,
                             partial.data() + (m0 - c0) * kF32PanelRows);
            }
            continue;
          }
          for (int64_t m0 = c0; m0 < c1; m0 += kF32TileRows) {
            f32_panel_rows(std::min<int64_t>(kF32TileRows, c1 - m0), a, a.w + panel * a.K * kF32PanelRows, m0, panel, k0,
                           k1, partial.data() + (m0 - c0) * kF32PanelRows);
          }
        }
      }
    });
  }
}

// x [M, K] fp32, weight [N / 32, K, 32, 1] fp32 or bf16 (pack_panels in linear.py), bias
// [N] or none -> [M, N] fp32. bf16 weights are widened to fp32 in registers: for CPUs whose
// vectors have no bf16 arithmetic, half the bytes of fp32 read, and fp32's arithmetic.
at::Tensor f32_panel_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t N) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || weight.scalar_type() == at::kFloat) && weight.dim() == 4 && weight.is_contiguous() &&
                  weight.size(2) == kF32PanelRows && weight.size(3) == 1,
              "f32_panel_linear: weight must be a contiguous fp32 or bf16 [N / 32, K, 32, 1]");
  const int64_t K = weight.size(1), panels = weight.size(0);
  TORCH_CHECK(K > 0, "f32_panel_linear: K must be positive");
  TORCH_CHECK(N > (panels - 1) * kF32PanelRows && N <= panels * kF32PanelRows, "f32_panel_linear: N = ", N,
              " does not fit ", panels, " panels");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K, "f32_panel_linear: x must be fp32 [M, ", K, "]");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == N, "f32_panel_linear: bias must be [N]");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());  // [M, N]
  if (M == 0) return out;
  at::Tensor xc = x.contiguous();
  at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();  // [N]
  const float* bp = has_bias ? bf.data_ptr<float>() : nullptr;
  if (bf16) {
    f32_panel_matmul(F32PanelArgs<c10::BFloat16>{xc.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), bp,
                                                 out.data_ptr<float>(), N, K}, M, panels);
  } else {
    f32_panel_matmul(F32PanelArgs<float>{xc.data_ptr<float>(), weight.data_ptr<float>(), bp, out.data_ptr<float>(), N, K},
                     M, panels);
  }
  return out;
}

// oneDNN-packed weights by key (PackableLinear.pack_for_cpu), held weakly: the layer owns
// its weight, so a dropped model is freed. The compiled graph names a weight by its key,
// as an opaque packed tensor cannot be a graph input.
std::mutex packed_mutex;
std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> packed_weights;

int64_t register_packed_weight(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(packed_mutex);
  packed_weights.emplace_back(weight.getIntrusivePtr());
  return static_cast<int64_t>(packed_weights.size()) - 1;
}

// x [n, in] -> [n, out] through the packed weight `key`: the product torch.compile's graph
// calls in every linear layer (4 per decoder layer). From the graph's C++ wrapper this is a
// dispatcher call with no Python, whose per-call cost would add up over every linear.
at::Tensor packed_linear(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t key) {
  c10::intrusive_ptr<c10::TensorImpl> impl;
  {
    std::lock_guard<std::mutex> lock(packed_mutex);
    TORCH_CHECK(key >= 0 && key < static_cast<int64_t>(packed_weights.size()), "no packed weight ", key);
    impl = packed_weights[key].lock();
  }
  TORCH_CHECK(impl, "packed weight ", key, " was freed");
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{
      x, at::Tensor(std::move(impl)), bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
      std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias, int few_rows_max) -> Tensor");
  m.def("bf16_gemv(Tensor x, Tensor weight) -> Tensor");
  m.def("bf16_gemv_supported() -> bool");
  m.def("panel_linear(Tensor x, Tensor weight, Tensor? bias, int N) -> Tensor");
  m.def("f32_panel_linear(Tensor x, Tensor weight, Tensor? bias, int N) -> Tensor");
  m.def("set_batch_invariant(bool on) -> ()");
  m.def("register_packed_weight(Tensor weight) -> int");
  m.def("packed_linear(Tensor x, Tensor? bias, int key) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_gemv", &bf16_gemv);
  m.impl("panel_linear", &panel_linear);
  m.impl("f32_panel_linear", &f32_panel_linear);
  m.impl("packed_linear", &packed_linear);
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CompositeExplicitAutograd, m) {
  m.impl("bf16_gemv_supported", &bf16_dot_supported);
  m.impl("set_batch_invariant", &set_batch_invariant);
  m.impl("register_packed_weight", &register_packed_weight);
}
