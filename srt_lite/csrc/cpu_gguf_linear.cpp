// srt_lite_cpu::gguf_linear and gguf_dequantize: products with a GGUF file's quantized
// weights, read in the file's own blocks (no repacked or full-precision copy).
//
// A weight is one or more parts, each uint8 [rows, row bytes] of one GGUF type, whose
// outputs are concatenated (a fused q/k/v projection may mix Q4_K and Q6_K rows).
//
// Every type is read a unit at a time (32 weights for Q4_0 ... Q8_0, 256 for the K-quants)
// into the same form: one code per weight and, per 16 weights, a scale a and an offset b,
// with w = a * code + b. Codes are unsigned (0..63) except Q8_0's, which stay signed.
//
// At few rows (decode) x is quantized per 32 values to int8 with a float scale, as llama.cpp
// does with its q8 activations, and each 32 weights meet each row in one integer dot
// product: x . w = dx * (a * sum(code * qx) + b * sum(qx)), the sum(qx) of each 16 values
// computed once with the quantization. Each output's units are added in order, whatever the
// number of rows, so a row's result does not depend on the other rows of its batch.
// At many rows (prefill) the weights are dequantized a slab of outputs at a time into the
// matmul's dtype and go through at::mm, whose speed there beats any integer dot loop.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// ggml's type ids.
enum GgmlType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

constexpr int64_t kMaxUnit = 256;       // weights of the largest unit (a K-quant super-block)
constexpr int64_t kHalves = kMaxUnit / 16;
constexpr int64_t kRowTile = 8;         // rows of x a pass over a weight row keeps in registers
constexpr int64_t kSlabBytes = 4 << 20;  // dequantized weight a matmul slab holds

struct TypeInfo {
  int64_t unit;   // weights per block
  int64_t bytes;  // bytes per block
};

TypeInfo type_info(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: TORCH_CHECK(false, "gguf: tensor type ", type, " has no kernel");
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// One unit read into codes [unit], and a, b [unit / 16] (w = a * code + b).
struct Unit {
  alignas(64) uint8_t codes[kMaxUnit];
  float a[kHalves];
  float b[kHalves];
};

// The 6-bit scale and minimum of sub-block j of a Q4_K / Q5_K super-block.
inline void k4_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Low nibbles of 16 bytes to codes [0, 16), high nibbles to [16, 32) (Q4_0 ... Q5_1).
inline void nibbles32(const uint8_t* qs, uint8_t* codes) {
  for (int l = 0; l < 16; ++l) {
    codes[l] = qs[l] & 0xF;
    codes[l + 16] = qs[l] >> 4;
  }
}

inline void high_bits32(const uint8_t* qh, uint8_t* codes) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  for (int l = 0; l < 32; ++l) codes[l] |= ((h >> l) & 1) << 4;
}

void read_unit(int64_t type, const uint8_t* blk, Unit& u) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: {
      const float d = half_at(blk);
      const bool has_min = type == kQ4_1 || type == kQ5_1;
      const bool five = type == kQ5_0 || type == kQ5_1;
      const uint8_t* q = blk + (has_min ? 4 : 2);
      nibbles32(q + (five ? 4 : 0), u.codes);
      if (five) high_bits32(q, u.codes);
      const float b = has_min ? half_at(blk + 2) : -d * (five ? 16.f : 8.f);
      u.a[0] = u.a[1] = d;
      u.b[0] = u.b[1] = b;
      return;
    }
    case kQ8_0: {
      const float d = half_at(blk);
      std::memcpy(u.codes, blk + 2, 32);  // signed
      u.a[0] = u.a[1] = d;
      u.b[0] = u.b[1] = 0.f;
      return;
    }
    case kQ4_K: case kQ5_K: {
      const float d = half_at(blk), dmin = half_at(blk + 2);
      const uint8_t* scales = blk + 4;
      const uint8_t* qh = blk + 16;
      const uint8_t* qs = blk + (type == kQ5_K ? 48 : 16);
      for (int c = 0; c < 4; ++c) {  // 64 weights: the low nibbles of 32 bytes, then the high
        uint8_t* lo = u.codes + 64 * c;
        for (int l = 0; l < 32; ++l) {
          lo[l] = qs[32 * c + l] & 0xF;
          lo[l + 32] = qs[32 * c + l] >> 4;
        }
        if (type == kQ5_K) {
          for (int l = 0; l < 32; ++l) {
            lo[l] |= ((qh[l] >> (2 * c)) & 1) << 4;
            lo[l + 32] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
          }
        }
      }
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        k4_scale_min(scales, j, sc, mn);
        u.a[2 * j] = u.a[2 * j + 1] = d * static_cast<float>(sc);
        u.b[2 * j] = u.b[2 * j + 1] = -dmin * static_cast<float>(mn);
      }
      return;
    }
    case kQ6_K: {
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = half_at(blk + 208);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* l4 = ql + 64 * h;
        const uint8_t* h2 = qh + 32 * h;
        uint8_t* c = u.codes + 128 * h;
        for (int l = 0; l < 32; ++l) {
          c[l] = (l4[l] & 0xF) | ((h2[l] & 3) << 4);
          c[l + 32] = (l4[l + 32] & 0xF) | (((h2[l] >> 2) & 3) << 4);
          c[l + 64] = (l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4);
          c[l + 96] = (l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4);
        }
      }
      for (int j = 0; j < 16; ++j) {
        u.a[j] = d * static_cast<float>(sc[j]);
        u.b[j] = -32.f * u.a[j];
      }
      return;
    }
    default: TORCH_CHECK(false, "gguf: tensor type ", type, " has no kernel");
  }
}

// One weight row [K] to float.
void dequantize_row(int64_t type, const uint8_t* row, int64_t K, float* out) {
  const TypeInfo info = type_info(type);
  Unit u;
  const bool is_signed = type == kQ8_0;
  for (int64_t k0 = 0; k0 < K; k0 += info.unit) {
    read_unit(type, row + (k0 / info.unit) * info.bytes, u);
    for (int64_t e = 0; e < info.unit; ++e) {
      const float code = is_signed ? static_cast<float>(static_cast<int8_t>(u.codes[e])) : static_cast<float>(u.codes[e]);
      out[k0 + e] = u.a[e / 16] * code + u.b[e / 16];
    }
  }
}

// x [M, K] quantized per 32 values: q int8 [M, K], dx [M, K / 32], and for each 16 values
// dx * sum(q) ([M, K / 16]).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<float> sums;
};

template <typename T>
QuantizedX quantize_x(const T* x, int64_t M, int64_t K) {
  QuantizedX out{std::vector<int8_t>(M * K), std::vector<float>(M * K / 32), std::vector<float>(M * K / 16)};
  at::parallel_for(0, M * K / 32, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      float v[32], amax = 0.f;
      for (int i = 0; i < 32; ++i) {
        v[i] = static_cast<float>(x[g * 32 + i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      int sum[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        const int q = static_cast<int>(std::nearbyint(v[i] * id));
        out.q[g * 32 + i] = static_cast<int8_t>(q);
        sum[i / 16] += q;
      }
      out.dx[g] = d;
      out.sums[2 * g] = d * static_cast<float>(sum[0]);
      out.sums[2 * g + 1] = d * static_cast<float>(sum[1]);
    }
  });
  return out;
}

// out[m, n] for rows [m0, m0 + mr) of x and one weight row, into y (fp32 [M, ldy]).
template <bool kSigned>
void dot_row(int64_t type, const uint8_t* row, int64_t K, const QuantizedX& xq, int64_t m0, int64_t mr, float* y,
             int64_t ldy) {
  const TypeInfo info = type_info(type);
  const int64_t groups = info.unit / 32;
  Unit u;
  float bias_acc[kRowTile] = {0};
#if defined(__AVX2__)
  __m256 acc[kRowTile];
  for (int m = 0; m < kRowTile; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
#else
  float acc[kRowTile] = {0};
#endif
  for (int64_t k0 = 0; k0 < K; k0 += info.unit) {
    read_unit(type, row + (k0 / info.unit) * info.bytes, u);
    for (int64_t m = 0; m < mr; ++m) {
      const int8_t* qx = xq.q.data() + (m0 + m) * K + k0;
      const float* dx = xq.dx.data() + ((m0 + m) * K + k0) / 32;
      const float* sums = xq.sums.data() + ((m0 + m) * K + k0) / 16;
      for (int64_t h = 0; h < 2 * groups; ++h) bias_acc[m] += u.b[h] * sums[h];
      for (int64_t g = 0; g < groups; ++g) {
#if defined(__AVX2__)
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.codes + 32 * g));
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 32 * g));
        __m256i p;
        if constexpr (kSigned) {
          p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(v, w));
        } else {
          p = _mm256_maddubs_epi16(w, v);
        }
        // int32 lane j holds weights 4j .. 4j + 3: lanes 0-3 the first 16, 4-7 the second.
        const __m256 s = _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(u.a[2 * g + 1]), _mm_set1_ps(u.a[2 * g])),
                                       _mm256_set1_ps(dx[g]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), s, acc[m]);
#else
        for (int half = 0; half < 2; ++half) {
          int32_t isum = 0;
          for (int i = 0; i < 16; ++i) {
            const int e = 32 * g + 16 * half + i;
            const int32_t c = kSigned ? static_cast<int8_t>(u.codes[e]) : u.codes[e];
            isum += c * qx[e];
          }
          acc[m] += u.a[2 * g + half] * dx[g] * static_cast<float>(isum);
        }
#endif
      }
    }
  }
  for (int64_t m = 0; m < mr; ++m) {
#if defined(__AVX2__)
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const float total = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#else
    const float total = acc[m];
#endif
    y[(m0 + m) * ldy] = total + bias_acc[m];
  }
}

struct Parts {
  std::vector<const uint8_t*> data;
  std::vector<int64_t> types, row_bytes, first;  // first: the part's first output
  int64_t N = 0;
};

Parts check_parts(const at::TensorList weights, at::IntArrayRef types, int64_t K) {
  TORCH_CHECK(!weights.empty() && weights.size() == types.size(), "gguf_linear: one type per weight part");
  Parts parts;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const TypeInfo info = type_info(types[i]);
    TORCH_CHECK(K % info.unit == 0, "gguf_linear: K = ", K, " is not a multiple of the block size ", info.unit);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.stride(1) == 1 &&
                    w.size(1) == K / info.unit * info.bytes,
                "gguf_linear: part ", i, " must be uint8 [rows, ", K / info.unit * info.bytes, "] with contiguous rows");
    parts.data.push_back(w.data_ptr<uint8_t>());
    parts.types.push_back(types[i]);
    parts.row_bytes.push_back(w.stride(0));
    parts.first.push_back(parts.N);
    parts.N += w.size(0);
  }
  return parts;
}

// y [M, N] fp32 through integer dot products.
void dot_linear(const at::Tensor& x, const Parts& parts, float* y) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedX xq = x.scalar_type() == at::kBFloat16 ? quantize_x(x.data_ptr<at::BFloat16>(), M, K)
                                                    : quantize_x(x.data_ptr<float>(), M, K);
  at::parallel_for(0, parts.N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const size_t p = std::upper_bound(parts.first.begin(), parts.first.end(), n) - parts.first.begin() - 1;
      const uint8_t* row = parts.data[p] + (n - parts.first[p]) * parts.row_bytes[p];
      for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
        const int64_t mr = std::min(kRowTile, M - m0);
        if (parts.types[p] == kQ8_0) {
          dot_row<true>(parts.types[p], row, K, xq, m0, mr, y + n, parts.N);
        } else {
          dot_row<false>(parts.types[p], row, K, xq, m0, mr, y + n, parts.N);
        }
      }
    }
  });
}

// Rows [n0, n0 + rows) of the parts, dequantized into out [rows, K] (of `dtype`).
void dequantize_rows(const Parts& parts, int64_t K, int64_t n0, int64_t rows, const at::Tensor& out) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(K);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = n0 + r;
      const size_t p = std::upper_bound(parts.first.begin(), parts.first.end(), n) - parts.first.begin() - 1;
      const uint8_t* row = parts.data[p] + (n - parts.first[p]) * parts.row_bytes[p];
      if (out.scalar_type() == at::kFloat) {
        dequantize_row(parts.types[p], row, K, out.data_ptr<float>() + r * K);
      } else {
        dequantize_row(parts.types[p], row, K, buf.data());
        at::BFloat16* o = out.data_ptr<at::BFloat16>() + r * K;
        for (int64_t k = 0; k < K; ++k) o[k] = static_cast<at::BFloat16>(buf[k]);
      }
    }
  });
}

// x [M, K] (fp32 or bf16) -> [M, N] in x's dtype. Up to `dot_rows` rows of x take the
// integer dot products; more go through at::mm on slabs dequantized to `mm_bf16` ? bf16 : fp32.
at::Tensor gguf_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                       const std::optional<at::Tensor>& bias, int64_t dot_rows, bool mm_bf16) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gguf_linear: x must be fp32 or bf16 [M, K]");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  const Parts parts = check_parts(weights, types, K);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == parts.N, "gguf_linear: bias must be [N]");
  at::Tensor y;
  if (M <= dot_rows) {
    y = at::empty({M, parts.N}, xc.options().dtype(at::kFloat));  // [M, N]
    if (M > 0) dot_linear(xc, parts, y.data_ptr<float>());
  } else {
    const auto mm_dtype = mm_bf16 ? at::kBFloat16 : at::kFloat;
    const at::Tensor xm = xc.to(mm_dtype);
    y = at::empty({M, parts.N}, xc.options().dtype(mm_dtype));  // [M, N]
    const int64_t slab = std::max<int64_t>(16, kSlabBytes / (K * (mm_bf16 ? 2 : 4)));
    at::Tensor w = at::empty({std::min(slab, parts.N), K}, xc.options().dtype(mm_dtype));  // [slab, K]
    for (int64_t n0 = 0; n0 < parts.N; n0 += slab) {
      const int64_t rows = std::min(slab, parts.N - n0);
      at::Tensor ws = w.narrow(0, 0, rows);
      dequantize_rows(parts, K, n0, rows, ws);
      at::Tensor ys = y.narrow(1, n0, rows);  // a strided column slab, written in place
      at::mm_out(ys, xm, ws.t());
    }
  }
  if (has_bias) y.add_(*bias);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// weight uint8 [N, K / unit * bytes] of `type` -> [N, K] float32.
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t K) {
  const at::Tensor w = weight.contiguous();
  const Parts parts = check_parts({w}, {type}, K);
  at::Tensor out = at::empty({parts.N, K}, w.options().dtype(at::kFloat));  // [N, K]
  dequantize_rows(parts, K, 0, parts.N, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor[] weights, int[] types, Tensor? bias, int dot_rows, bool mm_bf16) -> Tensor");
  m.def("gguf_dequantize(Tensor weight, int type, int K) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
}
