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
// computed once with the quantization. The K-quants take x per 256 values (llama.cpp's q8_K)
// instead and sum a whole super-block in integers, its 6- or 8-bit scales included, before
// one float multiply-add. Each output's units are added in order, whatever the
// number of rows, so a row's result does not depend on the other rows of its batch.
// At many rows (prefill) the weights are dequantized a slab of outputs at a time into the
// matmul's dtype and go through at::mm, whose speed there beats any integer dot loop.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

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
constexpr int64_t kStageTasks = 4;      // tasks of 16 outputs whose results a thread writes out together
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
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// One row's run of up to kMaxUnit weights read from its blocks: w = a * code + b, with a and b
// for each 16 weights. Past `n` (a run shorter than kMaxUnit) a = b = 0.
struct Unit {
  alignas(64) uint8_t codes[kMaxUnit];
  alignas(64) float a16[kHalves];
  alignas(64) float b16[kHalves];
  int64_t n;
};

// The eight 6-bit scales (bytes 0-7 of out) and minimums (8-15) of a Q4_K / Q5_K
// super-block, packed in 12 bytes (llama.cpp's unpacking).
inline void k4_scales_mins(const uint8_t* packed, uint32_t out[4]) {
  std::memcpy(out, packed, 12);
  const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  out[3] = ((out[2] >> 4) & m4) | (((out[1] >> 6) & m2) << 4);
  const uint32_t mins_lo = out[1] & m6;
  out[1] = (out[2] & m4) | (((out[0] >> 6) & m2) << 4);
  out[2] = mins_lo;
  out[0] &= m6;
}

inline void set_scale32(Unit& u, int64_t g, float a, float b) {  // weights [32 g, 32 g + 32)
  u.a16[2 * g] = u.a16[2 * g + 1] = a;
  u.b16[2 * g] = u.b16[2 * g + 1] = b;
}

// The eight sub-blocks' scales d * sc and offsets -dmin * m of a Q4_K / Q5_K super-block
// (6-bit fields packed in 12 bytes), each for its 32 weights.
inline void set_k4_scales(Unit& u, const uint8_t* packed, float d, float dmin) {
  uint32_t w[4];
  k4_scales_mins(packed, w);
#if defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
  const __m256 mn = _mm256_mul_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
  const __m256i lo = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0), hi = _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4);
  _mm256_store_ps(u.a16, _mm256_permutevar8x32_ps(sc, lo));
  _mm256_store_ps(u.a16 + 8, _mm256_permutevar8x32_ps(sc, hi));
  _mm256_store_ps(u.b16, _mm256_permutevar8x32_ps(mn, lo));
  _mm256_store_ps(u.b16 + 8, _mm256_permutevar8x32_ps(mn, hi));
#else
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w);
  for (int j = 0; j < 8; ++j) set_scale32(u, j, d * static_cast<float>(bytes[j]), -dmin * static_cast<float>(bytes[8 + j]));
#endif
}

#if defined(__AVX2__)
// kLines cache lines from p on, asked for ahead of use. A packed group (or a row) is read
// once, in order, and between its loads the kernels spend enough time on dot products that
// the hardware prefetcher does not keep the next block coming: with a few rows of x the
// products waited on memory for much of their time. The packed K-quant kernels ask, a slice
// per step, for the block after the one they work on; Q8_0's blocks are short, so its kernels
// ask a few blocks ahead. The VNNI kernels do not ask at one row: their steps are short
// enough there for the hardware prefetcher to keep ahead, and one row ran faster without them
// (docs/development.md).
template <int kLines>
inline void prefetch_lines(const uint8_t* p) {
  for (int i = 0; i < kLines; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * i), _MM_HINT_T0);
}

// The same, into L2 only (prefetcht1), kL2Ahead bytes or more ahead. Where a kernel's block
// takes long (the VNNI kernels from two rows on, AVX2's at every row count), one block ahead
// leaves too few lines in flight to keep the memory busy: with requests ~16 KB ahead into L2
// as well, a 4-row Q4_K product streamed at ~0.9 of a vector sum's rate instead of ~0.7. The
// same requests into L1 (prefetcht0) gained nothing; at one row the VNNI kernels were slower
// with them (docs/development.md).
constexpr int64_t kL2Ahead = 16384;
constexpr int64_t l2_ahead(int64_t block_bytes) { return (kL2Ahead + block_bytes - 1) / block_bytes * block_bytes; }
template <int kLines>
inline void prefetch_l2(const uint8_t* p) {
  for (int i = 0; i < kLines; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * i), _MM_HINT_T1);
}

// The kLines at `slice` of the block a kernel works on (block_bytes long), asked for in the
// next block (into L1) and in a block kL2Ahead bytes or more on (into L2).
template <int kLines>
inline void prefetch_ahead(const uint8_t* slice, int64_t block_bytes) {
  prefetch_lines<kLines>(slice + block_bytes);
  prefetch_l2<kLines>(slice + l2_ahead(block_bytes));
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Loads kLines cache lines from p on, into registers nothing reads. A packed K-quant block
// holds its scales ahead of its codes, but the kernels read the scales of each chunk after
// its codes, so the block's lines were first touched out of address order. At one row, where
// the hardware prefetcher alone streams best (no software requests, above), touching the
// scales' lines at the block's start made the decode step faster (docs/development.md).
template <int kLines>
__attribute__((target("avx512f"))) inline void touch_lines(const uint8_t* p) {
  for (int i = 0; i < kLines; ++i) asm volatile("" : : "v"(_mm512_loadu_si512(p + 64 * i)));
}
inline void store32(uint8_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
// Byte l = 0xFF where bit l of the 32-bit word at p is set (llama.cpp's bytes_from_bits_32).
inline __m256i bits_to_bytes(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// The 256 codes (unsigned, 0..63) of a Q4_K, Q5_K or Q6_K super-block in weight order, 32 a
// vector.
inline void k_codes(int64_t type, const uint8_t* blk, __m256i w[8]) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  if (type == kQ6_K) {  // 4 low bits in ql (blk), 2 high bits in qh (blk + 128)
    const __m256i m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(blk + 64 * h), l1 = load32(blk + 64 * h + 32), hb = load32(blk + 128 + 32 * h);
      w[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
      w[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
      w[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30));
      w[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                     _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
    }
    return;
  }
  const bool five = type == kQ5_K;
  const uint8_t* qs = blk + (five ? 48 : 16);
  const __m256i hv = five ? load32(blk + 16) : _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {  // 32 bytes: the low nibbles are weights 64c.., the high 64c + 32..
    const __m256i v = load32(qs + 32 * c);
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (five) {
      const __m256i bl = _mm256_set1_epi8(static_cast<char>(1 << (2 * c))), bh = _mm256_set1_epi8(static_cast<char>(2 << (2 * c)));
      const __m256i fifth = _mm256_set1_epi8(0x10);
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, bl), bl), fifth));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, bh), bh), fifth));
    }
    w[2 * c] = lo;
    w[2 * c + 1] = hi;
  }
}
#endif

// The codes of one 32-weight block of Q4_0 / Q4_1 / Q5_0 / Q5_1: low nibbles first, the
// fifth bit of element l in bit l of qh.
inline void legacy_codes(const uint8_t* qs, const uint8_t* qh, uint8_t* codes) {
#if defined(__AVX2__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0xF)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0xF));
  __m256i c = _mm256_set_m128i(hi, lo);
  if (qh) c = _mm256_or_si256(c, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
  store32(codes, c);
#else
  uint32_t h = 0;
  if (qh) std::memcpy(&h, qh, 4);
  for (int l = 0; l < 16; ++l) {
    codes[l] = (qs[l] & 0xF) | (((h >> l) & 1) << 4);
    codes[l + 16] = (qs[l] >> 4) | (((h >> (l + 16)) & 1) << 4);
  }
#endif
}

// read_unit's parts, forced inline: read_unit runs for every 256 weights of the products,
// and each part should compile into it as one body, not a call.
#if defined(__GNUC__)
#define GGUF_READ_INLINE inline __attribute__((always_inline))
#else
#define GGUF_READ_INLINE inline
#endif

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: n / 32 blocks of 32 weights with one scale (and minimum) each.
template <bool kOffset8>
GGUF_READ_INLINE void read_small_blocks(int64_t type, const uint8_t* row, int64_t k0, int64_t n, Unit& u) {
  const TypeInfo info = type_info(type);
  for (int64_t g = 0; g < n / 32; ++g) {
    const uint8_t* blk = row + (k0 / 32 + g) * info.bytes;
    const float d = half_at(blk);
    if (type == kQ8_0) {
#if defined(__AVX2__)
      __m256i q = load32(blk + 2);
      if (kOffset8) q = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
      store32(u.codes + 32 * g, q);
#else
      for (int l = 0; l < 32; ++l) u.codes[32 * g + l] = blk[2 + l] ^ (kOffset8 ? 0x80 : 0);
#endif
      set_scale32(u, g, d, kOffset8 ? -128.f * d : 0.f);
      continue;
    }
    const bool has_min = type == kQ4_1 || type == kQ5_1, five = type == kQ5_0 || type == kQ5_1;
    const uint8_t* q = blk + (has_min ? 4 : 2);
    legacy_codes(q + (five ? 4 : 0), five ? q : nullptr, u.codes + 32 * g);
    set_scale32(u, g, d, has_min ? half_at(blk + 2) : -d * (five ? 16.f : 8.f));
  }
}

// Q4_K / Q5_K: one super-block of 8 x 32 weights, 4-bit codes (and Q5_K's fifth bits).
GGUF_READ_INLINE void read_k4_block(int64_t type, const uint8_t* row, int64_t k0, Unit& u) {
  const uint8_t* blk = row + (k0 / 256) * (type == kQ5_K ? 176 : 144);
  const float d = half_at(blk), dmin = half_at(blk + 2);
#if defined(__AVX2__)
  __m256i w[8];
  k_codes(type, blk, w);
  for (int i = 0; i < 8; ++i) store32(u.codes + 32 * i, w[i]);
#else
  // 64 weights at a time: the low nibbles of 32 bytes, then their high nibbles.
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + (type == kQ5_K ? 48 : 16);
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      uint8_t lo = qs[32 * c + l] & 0xF, hi = qs[32 * c + l] >> 4;
      if (type == kQ5_K) {
        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
      u.codes[64 * c + l] = lo;
      u.codes[64 * c + 32 + l] = hi;
    }
  }
#endif
  set_k4_scales(u, blk + 4, d, dmin);
}

// Q6_K: one super-block of 16 x 16 weights, 4 low and 2 high bits a code.
GGUF_READ_INLINE void read_q6k_block(const uint8_t* row, int64_t k0, Unit& u) {
  const uint8_t* blk = row + (k0 / 256) * 210;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const float d = half_at(blk + 208);
#if defined(__AVX2__)
  __m256i w[8];
  k_codes(kQ6_K, blk, w);
  for (int i = 0; i < 8; ++i) store32(u.codes + 32 * i, w[i]);
#else
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  for (int h = 0; h < 2; ++h) {
    uint8_t* c = u.codes + 128 * h;
    const uint8_t* l4 = ql + 64 * h;
    const uint8_t* h2 = qh + 32 * h;
    for (int l = 0; l < 32; ++l) {
      c[l] = (l4[l] & 0xF) | ((h2[l] & 3) << 4);
      c[l + 32] = (l4[l + 32] & 0xF) | (((h2[l] >> 2) & 3) << 4);
      c[l + 64] = (l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4);
      c[l + 96] = (l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4);
    }
  }
#endif
#if defined(__AVX2__)
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
  const __m256 dv = _mm256_set1_ps(d), m32 = _mm256_set1_ps(-32.f);
  const __m256 lo = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)));
  const __m256 hi = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))));
  _mm256_store_ps(u.a16, lo);
  _mm256_store_ps(u.a16 + 8, hi);
  _mm256_store_ps(u.b16, _mm256_mul_ps(m32, lo));
  _mm256_store_ps(u.b16 + 8, _mm256_mul_ps(m32, hi));
#else
  for (int j = 0; j < 16; ++j) {
    u.a16[j] = d * static_cast<float>(sc[j]);
    u.b16[j] = -32.f * u.a16[j];
  }
#endif
}

// Reads weights [k0, k0 + n) of one row (n a multiple of the type's block, at most kMaxUnit).
// Q8_0's codes are its signed values unless kOffset8, where they are value + 128 (b = -128 a).
template <bool kOffset8>
void read_unit(int64_t type, const uint8_t* row, int64_t k0, int64_t n, Unit& u) {
  u.n = n;
  if (n < kMaxUnit) {
    std::memset(u.a16 + n / 16, 0, (kMaxUnit - n) / 4);
    std::memset(u.b16 + n / 16, 0, (kMaxUnit - n) / 4);
  }
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: return read_small_blocks<kOffset8>(type, row, k0, n, u);
    case kQ4_K: case kQ5_K: return read_k4_block(type, row, k0, u);
    case kQ6_K: return read_q6k_block(row, k0, u);
    default: TORCH_CHECK(false, "gguf: tensor type ", type, " has no kernel");
  }
}

// The run of weights read at a time from a row: a super-block, or up to 8 small blocks.
inline int64_t run_length(int64_t K, int64_t k0) { return std::min<int64_t>(kMaxUnit, K - k0); }

// One weight row [K] to float32 or bf16 (rounded to nearest even, as at::BFloat16 rounds).
template <typename T>
void dequantize_row(int64_t type, const uint8_t* row, int64_t K, T* out) {
  Unit u;
  const bool is_signed = type == kQ8_0;
  for (int64_t k0 = 0; k0 < K; k0 += kMaxUnit) {
    read_unit<false>(type, row, k0, run_length(K, k0), u);
    int64_t e = 0;
#if defined(__AVX2__)
    for (; e < u.n; e += 8) {
      const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u.codes + e));
      const __m256 c = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(c8) : _mm256_cvtepu8_epi32(c8));
      // a * code + b rounded once each, as the scalar loop below (no fused multiply-add).
      const __m256 w = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(u.a16[e / 16]), c), _mm256_set1_ps(u.b16[e / 16]));
      if constexpr (std::is_same_v<T, float>) {
        _mm256_storeu_ps(out + k0 + e, w);
      } else {
        const __m256i bits = _mm256_castps_si256(w);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k0 + e), packed);
      }
    }
#endif
    for (; e < u.n; ++e) {
      const float code = is_signed ? static_cast<float>(static_cast<int8_t>(u.codes[e])) : static_cast<float>(u.codes[e]);
      out[k0 + e] = static_cast<T>(u.a16[e / 16] * code + u.b16[e / 16]);
    }
  }
}

// x [M, K] quantized per 32 values, rows padded with zeros to Kp (a multiple of kMaxUnit):
// q int8 [M, Kp]; dx4 [M, Kp / 4], each 32 values' scale repeated for each 4 (the lanes of a
// dot product); sums [M, Kp / 16], dx * sum(q) of each 16 values.
struct QuantizedX {
  int64_t Kp;
  std::vector<int8_t> q;
  std::vector<float> dx4;
  std::vector<float> sums;
  // For the K-quants' super-block products (quantize_x256): x per 256 values, as llama.cpp's
  // q8_K: q256 int8 [M, Kp], d256 [M, Kp / 256], sum16 int16 [M, Kp / 16] (sum of q256).
  std::vector<int8_t> q256;
  std::vector<float> d256;
  std::vector<int16_t> sum16;
  std::vector<int16_t> sum32;  // [M, Kp / 32], sum of q256 per 32 (the packed Q4_K's minimums)
};

// x's values as fp32, a vector at a time (bf16 widens exactly: its bits are fp32's top half).
#if defined(__AVX512F__)
inline __m512 load_f32x16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_f32x16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#elif defined(__AVX2__)
inline __m256 load_f32x8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_f32x8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline int hsum_i32x8(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}
#endif

// The largest |x| of n values (n a multiple of 16).
template <typename T>
inline float abs_max(const T* x, int64_t n) {
  float amax = 0.f;
  int64_t l = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; l < n; l += 16) m = _mm512_max_ps(_mm512_abs_ps(load_f32x16(x + l)), m);  // a NaN is passed over, as std::max does
  amax = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (; l < n; l += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, load_f32x8(x + l)), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; l < n; ++l) amax = std::max(amax, std::fabs(static_cast<float>(x[l])));
  return amax;
}

// q[l] = x[l] * id rounded to the nearest integer (ties to even, as std::nearbyint in the
// default rounding mode; the vector conversions round the same way) for n values (a multiple
// of 16), and sums[j] the sum of q over values [16 j, 16 j + 16).
template <typename T>
inline void round_scaled(const T* x, int64_t n, float id, int8_t* q, int* sums) {
  int64_t l = 0;
#if defined(__AVX512F__)
  const __m512 vid = _mm512_set1_ps(id);
  for (; l < n; l += 16) {
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(load_f32x16(x + l), vid));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + l), _mm512_cvtepi32_epi8(qi));
    sums[l / 16] = _mm512_reduce_add_epi32(qi);
  }
#elif defined(__AVX2__)
  const __m256 vid = _mm256_set1_ps(id);
  for (; l < n; l += 16) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(load_f32x8(x + l), vid));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(load_f32x8(x + l + 8), vid));
    const __m128i wa = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    const __m128i wb = _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + l), _mm_packs_epi16(wa, wb));  // |q| <= 127: no saturation
    sums[l / 16] = hsum_i32x8(_mm256_add_epi32(a, b));
  }
#endif
  for (; l < n; l += 16) {
    int sum = 0;
    for (int64_t e = l; e < l + 16; ++e) {
      const int qi = static_cast<int>(std::nearbyint(static_cast<float>(x[e]) * id));
      q[e] = static_cast<int8_t>(qi);
      sum += qi;
    }
    sums[l / 16] = sum;
  }
}

// Units of quantization a thread takes at least: at a few rows the whole of x is quantized in
// less time than waking the other threads costs.
constexpr int64_t kQuantizeGrain = 1 << 14;  // values

// Fills xq's per-256 fields from x [M, K] (K a multiple of 256).
template <typename T>
void quantize_x256(const T* x, int64_t M, int64_t K, QuantizedX& xq) {
  const int64_t Kp = xq.Kp, blocks = K / 256;
  xq.q256.assign(M * Kp, 0);
  xq.d256.assign(M * Kp / 256, 0.f);
  xq.sum16.assign(M * Kp / 16, 0);
  xq.sum32.assign(M * Kp / 32, 0);
  at::parallel_for(0, M * blocks, kQuantizeGrain / 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / blocks, b = i % blocks;
      const T* src = x + m * K + 256 * b;
      const float d = abs_max(src, 256) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      int sums[16];
      round_scaled(src, 256, id, xq.q256.data() + m * Kp + 256 * b, sums);
      int16_t* sum16 = xq.sum16.data() + (m * Kp + 256 * b) / 16;
      for (int j = 0; j < 16; ++j) sum16[j] = static_cast<int16_t>(sums[j]);
      for (int j = 0; j < 8; ++j) xq.sum32[(m * Kp + 256 * b) / 32 + j] = static_cast<int16_t>(sums[2 * j] + sums[2 * j + 1]);
      xq.d256[(m * Kp) / 256 + b] = d;
    }
  });
}

// Fills xq's per-32 fields from x [M, K].
template <typename T>
void quantize_x32(const T* x, int64_t M, int64_t K, QuantizedX& out) {
  const int64_t Kp = out.Kp;
  out.q.assign(M * Kp, 0);
  out.dx4.assign(M * Kp / 4, 0.f);
  out.sums.assign(M * Kp / 16, 0.f);
  const int64_t groups = K / 32;
  at::parallel_for(0, M * groups, kQuantizeGrain / 32, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / groups, g = i % groups;
      const T* src = x + m * K + 32 * g;
      const float d = abs_max(src, 32) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      int sum[2];
      round_scaled(src, 32, id, out.q.data() + m * Kp + 32 * g, sum);
      float* dx4 = out.dx4.data() + (m * Kp + 32 * g) / 4;
      for (int l = 0; l < 8; ++l) dx4[l] = d;
      out.sums[(m * Kp + 32 * g) / 16] = d * static_cast<float>(sum[0]);
      out.sums[(m * Kp + 32 * g) / 16 + 1] = d * static_cast<float>(sum[1]);
    }
  });
}

bool g_allow_vnni = false;  // set from srt_lite.cpu_caps (SRT_LITE_CPU_CAPS may deny it)

inline bool is_k_type(int64_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

void gguf_allow_vnni(bool allow) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  g_allow_vnni = allow && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
#else
  g_allow_vnni = false;
#endif
}

// acc[m] (lanes of a dot product) and bacc[m] (the offsets' sums) of rows [m0, m0 + MR) of x
// against one run of a weight row. Each product adds its runs in order, whatever MR is.
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
// 64 bytes of a Unit read as two 32-byte halves: read_unit writes 32 bytes at a time, and a
// 64-byte load of two fresh 32-byte stores cannot be forwarded from them (a stall each).
__attribute__((target("avx512f")))
inline __m512i load64_halves(const void* p) {
  const __m256i* h = static_cast<const __m256i*>(p);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256(h)), _mm256_load_si256(h + 1), 1);
}

template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void run_vnni(const Unit& u, const QuantizedX& xq, int64_t m0, int64_t k0, __m512* acc, __m512* bacc) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512 a16 = _mm512_castsi512_ps(load64_halves(u.a16));
  // Lane j of 64 weights' dot product covers weights 4j .. 4j + 3: its scale is a16[j / 4].
  const __m512i lane16 = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
  for (int64_t p = 0; p < (u.n + 63) / 64; ++p) {
    const __m512i w = load64_halves(u.codes + 64 * p);
    const __m512 a = _mm512_permutexvar_ps(_mm512_add_epi32(lane16, _mm512_set1_epi32(4 * p)), a16);
    for (int m = 0; m < MR; ++m) {
      const int64_t base = (m0 + m) * xq.Kp + k0 + 64 * p;
      const __m512i v = _mm512_loadu_si512(xq.q.data() + base);
      const __m512 s = _mm512_mul_ps(a, _mm512_loadu_ps(xq.dx4.data() + base / 4));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, w, v)), s, acc[m]);
    }
  }
  const __m512 b = _mm512_castsi512_ps(load64_halves(u.b16));
  for (int m = 0; m < MR; ++m) {
    bacc[m] = _mm512_fmadd_ps(b, _mm512_loadu_ps(xq.sums.data() + ((m0 + m) * xq.Kp + k0) / 16), bacc[m]);
  }
}

// A K-quant super-block in registers: codes [4][64] (unsigned), each 64's sub-block scales
// as int16 lanes of its byte-pair sums (sc), the offsets' coefficients per 16 weights (off),
// and the float factors: w = d * sc * code + off_scale * off (per 16 weights).
struct KBlock {
  __m512i w[4];
  __m512i sc[4];
  __m256i off;
  float d, off_scale;
};

__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void read_k_block(int64_t type, const uint8_t* blk, KBlock& kb) {
  const __m512i m4 = _mm512_set1_epi8(0xF);
  // int16 lane l of byte pairs 2l, 2l + 1: the scale of weights 2l, 2l + 1 of the 64.
  const __m512i lane = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12,
                                        11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  if (type == kQ6_K) {
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const __m512i m30 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i l = _mm512_loadu_si512(ql + 64 * h);
      const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h)));
      kb.w[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4),
                                    _mm512_and_si512(_mm512_sllv_epi64(hb, _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4)), m30));
      kb.w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                        _mm512_and_si512(_mm512_srlv_epi64(hb, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0)), m30));
    }
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    for (int p = 0; p < 4; ++p) {  // 16 weights a scale: lanes 8i .. 8i + 7 take scale 4p + i
      const __m512i idx = _mm512_add_epi16(_mm512_srli_epi16(lane, 3), _mm512_set1_epi16(static_cast<short>(4 * p)));
      kb.sc[p] = _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(sc16));
    }
    kb.off = sc16;
    kb.d = half_at(blk + 208);
    kb.off_scale = -32.f * kb.d;
    return;
  }
  const bool five = type == kQ5_K;
  const uint8_t* qs = blk + (five ? 48 : 16);
  for (int h = 0; h < 2; ++h) {  // 128 weights: chunks 2h and 2h + 1 of 32 bytes
    const __m512i v = _mm512_loadu_si512(qs + 64 * h);
    const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    kb.w[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);      // chunk 2h: its low nibbles, then its high
    kb.w[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);  // chunk 2h + 1
  }
  if (five) {
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
    for (int c = 0; c < 4; ++c) {  // bit 2c: the fifth bit of the low half, 2c + 1 of the high
      const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * c))),
                                             _mm256_set1_epi8(static_cast<char>(2 << (2 * c))), 1);
      kb.w[c] = _mm512_or_si512(kb.w[c], _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bit), _mm512_set1_epi8(0x10)));
    }
  }
  uint32_t u[4];
  k4_scales_mins(blk + 4, u);
  const __m256i sm = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u)));  // sc[0..7], m[0..7]
  for (int p = 0; p < 4; ++p) {  // 32 weights a scale: lanes 16i .. 16i + 15 take scale 2p + i
    const __m512i idx = _mm512_add_epi16(_mm512_srli_epi16(lane, 4), _mm512_set1_epi16(static_cast<short>(2 * p)));
    kb.sc[p] = _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(sm));
  }
  // off per 16 weights: the minimum of its 32 (lanes 8 + j / 2).
  const __m256i idx16 = _mm256_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  kb.off = _mm256_permutexvar_epi16(idx16, sm);
  kb.d = half_at(blk);
  kb.off_scale = -half_at(blk + 2);
}

// Rows [m0, m0 + MR) of x against one row of a K-quant, a super-block at a time: byte-pair
// sums (vpmaddubsw) weighted by the sub-block scales into int32 (vpdpwssd), then one float
// multiply-add per super-block with d * dx, as llama.cpp's q8_K products do.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void row_vnni_k(int64_t type, const uint8_t* row, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  const int64_t bytes = type_info(type).bytes;
  __m512 acc[MR];
  __m256 oacc[MR];
  for (int m = 0; m < MR; ++m) {
    acc[m] = _mm512_setzero_ps();
    oacc[m] = _mm256_setzero_ps();
  }
  KBlock kb;
  for (int64_t b = 0; b < K / 256; ++b) {
    read_k_block(type, row + b * bytes, kb);
    for (int m = 0; m < MR; ++m) {
      const int64_t base = (m0 + m) * xq.Kp + 256 * b;
      const int8_t* q = xq.q256.data() + base;
      __m512i isum = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        const __m512i pairs = _mm512_maddubs_epi16(kb.w[p], _mm512_loadu_si512(q + 64 * p));
        isum = _mm512_dpwssd_epi32(isum, pairs, kb.sc[p]);
      }
      const float dx = xq.d256[base / 256];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(kb.d * dx), acc[m]);
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.sum16.data() + base / 16));
      oacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums, kb.off)), _mm256_set1_ps(kb.off_scale * dx),
                                oacc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m256 o = oacc[m];
    const __m128 o4 = _mm_add_ps(_mm256_castps256_ps128(o), _mm256_extractf128_ps(o, 1));
    const __m128 o2 = _mm_add_ps(o4, _mm_movehl_ps(o4, o4));
    y[(m0 + m) * ldy] = _mm512_reduce_add_ps(acc[m]) + _mm_cvtss_f32(_mm_add_ss(o2, _mm_movehdup_ps(o2)));
  }
}

template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void row_vnni(int64_t type, const uint8_t* row, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  if (is_k_type(type)) return row_vnni_k<MR>(type, row, K, xq, m0, y, ldy);
  __m512 acc[MR], bacc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = bacc[m] = _mm512_setzero_ps();
  Unit u;
  for (int64_t k0 = 0; k0 < K; k0 += kMaxUnit) {
    read_unit<true>(type, row, k0, run_length(K, k0), u);
    run_vnni<MR>(u, xq, m0, k0, acc, bacc);
  }
  for (int m = 0; m < MR; ++m) y[(m0 + m) * ldy] = _mm512_reduce_add_ps(acc[m]) + _mm512_reduce_add_ps(bacc[m]);
}
#endif

#if defined(__AVX2__)
inline float hsum256(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
#endif

// The same without VNNI for the 32-weight blocks: AVX2's byte products (Q8_0 takes row_q80
// there), or plain C++.
template <int MR>
void row_plain(int64_t type, const uint8_t* row, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  Unit u;
#if defined(__AVX2__)
  __m256 acc[MR], bacc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = bacc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
#else
  float acc[MR] = {0}, bacc[MR] = {0};
#endif
  for (int64_t k0 = 0; k0 < K; k0 += kMaxUnit) {
    read_unit<false>(type, row, k0, run_length(K, k0), u);
#if defined(__AVX2__)
    for (int64_t h = 0; h < u.n / 32; ++h) {
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.codes + 32 * h));
      // Lane j covers weights 4j .. 4j + 3 of the 32: scale a16[2h + j / 4].
      const __m256 a = _mm256_permutevar8x32_ps(_mm256_load_ps(u.a16 + (2 * h & ~7)),
                                                _mm256_add_epi32(_mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0),
                                                                 _mm256_set1_epi32(2 * h & 7)));
      for (int m = 0; m < MR; ++m) {
        const int64_t base = (m0 + m) * xq.Kp + k0 + 32 * h;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + base));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, v), ones);
        const __m256 s = _mm256_mul_ps(a, _mm256_loadu_ps(xq.dx4.data() + base / 4));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const float* sums = xq.sums.data() + ((m0 + m) * xq.Kp + k0) / 16;
      bacc[m] = _mm256_fmadd_ps(_mm256_load_ps(u.b16), _mm256_loadu_ps(sums), bacc[m]);
      bacc[m] = _mm256_fmadd_ps(_mm256_load_ps(u.b16 + 8), _mm256_loadu_ps(sums + 8), bacc[m]);
    }
#else
    const bool is_signed = type == kQ8_0;
    for (int m = 0; m < MR; ++m) {
      const int64_t base = (m0 + m) * xq.Kp + k0;
      for (int64_t j = 0; j < u.n / 4; ++j) {
        int32_t dot = 0;
        for (int i = 0; i < 4; ++i) {
          const int32_t c = is_signed ? static_cast<int8_t>(u.codes[4 * j + i]) : u.codes[4 * j + i];
          dot += c * xq.q[base + 4 * j + i];
        }
        acc[m] += static_cast<float>(dot) * (u.a16[j / 4] * xq.dx4[base / 4 + j]);
      }
      for (int64_t j = 0; j < u.n / 16; ++j) bacc[m] += u.b16[j] * xq.sums[base / 16 + j];
    }
#endif
  }
  for (int m = 0; m < MR; ++m) {
#if defined(__AVX2__)
    y[(m0 + m) * ldy] = hsum256(acc[m]) + hsum256(bacc[m]);
#else
    y[(m0 + m) * ldy] = acc[m] + bacc[m];
#endif
  }
}

#if defined(__AVX2__)
// A K-quant super-block's scales as vectors for AVX2's byte-pair sums: sc[j] weights the 16
// int16 sums of codes 32j .. 32j + 31 (lanes 0-7 the first 16 codes, 8-15 the next), off the
// 16 sums of x per 16 values; w = d * sc * code + off_scale * off.
struct KScaleVecs {
  __m256i sc[8];
  __m256i off;
  float d, off_scale;
};

inline KScaleVecs k_scale_vecs(int64_t type, const uint8_t* blk) {
  // int16 lane i of a 128-bit half takes int16 lane i / 2 of the half's source.
  const __m256i pairs = _mm256_setr_epi8(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7, 8, 9, 8, 9, 10, 11, 10, 11, 12,
                                         13, 12, 13, 14, 15, 14, 15);
  KScaleVecs s;
  __m256i per16;  // int16 [16]: the scale of each 16 codes
  if (type == kQ6_K) {
    per16 = s.off = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    s.d = half_at(blk + 208);
    s.off_scale = -32.f * s.d;
  } else {
    uint32_t packed[4];
    k4_scales_mins(blk + 4, packed);
    const __m256i s16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed)));  // sc, m
    per16 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(s16, 0x44), pairs);
    s.off = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(s16, 0xEE), pairs);
    s.d = half_at(blk);
    s.off_scale = -half_at(blk + 2);
  }
  const __m256i lo = _mm256_permute4x64_epi64(per16, 0x44), hi = _mm256_permute4x64_epi64(per16, 0xEE);
  for (int j = 0; j < 8; ++j) {  // the low half takes scale 2j, the high half 2j + 1 (of 8 in lo or hi)
    const char a = static_cast<char>(4 * j % 16), b = static_cast<char>((4 * j + 2) % 16);
    const __m256i pick = _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1,
                                          b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1);
    s.sc[j] = _mm256_shuffle_epi8(j < 4 ? lo : hi, pick);
  }
  return s;
}

// Rows [m0, m0 + MR) of x (quantized per 256) against one row of a K-quant without VNNI, a
// super-block at a time as llama.cpp's q8_K products: byte-pair sums (vpmaddubsw) weighted by
// the 16-weight scales into int32 (vpmaddwd), then one float multiply-add per super-block with
// d * dx. Each row's sums run in the same order whatever MR is.
template <int MR>
void row_k(int64_t type, const uint8_t* row, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  const int64_t bytes = type_info(type).bytes;
  __m256 acc[MR], oacc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = oacc[m] = _mm256_setzero_ps();
  __m256i w[8];
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = row + b * bytes;
    prefetch_lines<4>(blk + 1024);  // as row_q80: the stream's lines 16 on, a block's worth a block
    k_codes(type, blk, w);
    const KScaleVecs s = k_scale_vecs(type, blk);
    for (int m = 0; m < MR; ++m) {
      const int64_t base = (m0 + m) * xq.Kp + 256 * b;
      const int8_t* q = xq.q256.data() + base;
      __m256i isum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(w[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j)));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, s.sc[j]));
      }
      const float dx = xq.d256[base / 256];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(s.d * dx), acc[m]);
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.sum16.data() + base / 16));
      oacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums, s.off)), _mm256_set1_ps(s.off_scale * dx),
                                oacc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) y[(m0 + m) * ldy] = hsum256(acc[m]) + hsum256(oacc[m]);
}
#else
// A K-quant super-block's integer scales per 16 weights, for products that sum codes times
// int8 x in integers: sc of the codes, off of the offsets (times the 16 values' sum of x),
// and the float factors, w = d * sc * code + off_scale * off.
struct KScales {
  alignas(32) int16_t sc[16];
  alignas(32) int16_t off[16];
  float d, off_scale;
};

inline void k_scales(int64_t type, const uint8_t* blk, KScales& s) {
  if (type == kQ6_K) {  // signed 8-bit scales, codes offset by 32
    for (int j = 0; j < 16; ++j) s.sc[j] = s.off[j] = static_cast<int8_t>(blk[192 + j]);
    s.d = half_at(blk + 208);
    s.off_scale = -32.f * s.d;
    return;
  }
  uint32_t packed[4];
  k4_scales_mins(blk + 4, packed);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(packed);  // 6-bit scales, then minimums
  for (int j = 0; j < 16; ++j) {
    s.sc[j] = bytes[j / 2];
    s.off[j] = bytes[8 + j / 2];
  }
  s.d = half_at(blk);
  s.off_scale = -half_at(blk + 2);
}

// row_k of the portable build: the same integer sums in plain C++.
template <int MR>
void row_k(int64_t type, const uint8_t* row, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  const int64_t bytes = type_info(type).bytes;
  float acc[MR] = {0}, oacc[MR] = {0};
  Unit u;
  KScales s;
  for (int64_t b = 0; b < K / 256; ++b) {
    read_unit<false>(type, row, 256 * b, 256, u);
    k_scales(type, row + b * bytes, s);
    for (int m = 0; m < MR; ++m) {
      const int64_t base = (m0 + m) * xq.Kp + 256 * b;
      const int8_t* q = xq.q256.data() + base;
      const int16_t* sums = xq.sum16.data() + base / 16;
      int32_t isum = 0, osum = 0;
      for (int j = 0; j < 16; ++j) {
        int32_t dot = 0;
        for (int l = 16 * j; l < 16 * j + 16; ++l) dot += static_cast<int32_t>(u.codes[l]) * q[l];
        isum += dot * s.sc[j];
        osum += static_cast<int32_t>(sums[j]) * s.off[j];
      }
      const float dx = xq.d256[base / 256];
      acc[m] += static_cast<float>(isum) * (s.d * dx);
      oacc[m] += static_cast<float>(osum) * (s.off_scale * dx);
    }
  }
  for (int m = 0; m < MR; ++m) y[(m0 + m) * ldy] = acc[m] + oacc[m];
}
#endif

#if defined(__AVX2__)
// Rows [m0, m0 + MR) of x (quantized per 32) against one Q8_0 row read straight from its
// blocks: the sign trick moves the codes' signs onto x, so vpmaddubsw takes them as unsigned
// (llama.cpp's AVX2 q8_0 product).
template <int MR>
void row_q80(const uint8_t* row, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < K / 32; ++g) {
    const uint8_t* blk = row + 34 * g;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);  // 16 lines on, past the row's end too
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    const __m256i wabs = _mm256_sign_epi8(w, w);
    const float d = half_at(blk);
    for (int m = 0; m < MR; ++m) {
      const int64_t base = (m0 + m) * xq.Kp + 32 * g;
      const __m256i v = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + base)), w);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, v), ones);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * xq.dx4[base / 4]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) y[(m0 + m) * ldy] = hsum256(acc[m]);
}
#endif

template <int MR>
void dot_row(int64_t type, const uint8_t* row, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
  if (g_allow_vnni) return row_vnni<MR>(type, row, K, xq, m0, y, ldy);
#endif
  if (is_k_type(type)) return row_k<MR>(type, row, K, xq, m0, y, ldy);
#if defined(__AVX2__)
  if (type == kQ8_0) return row_q80<MR>(row, K, xq, m0, y, ldy);
#endif
  row_plain<MR>(type, row, K, xq, m0, y, ldy);
}

void dot_rows(int64_t type, const uint8_t* row, int64_t K, const QuantizedX& xq, int64_t m0, int64_t mr, float* y,
              int64_t ldy) {
  switch (mr) {
    case 1: return dot_row<1>(type, row, K, xq, m0, y, ldy);
    case 2: return dot_row<2>(type, row, K, xq, m0, y, ldy);
    case 3: return dot_row<3>(type, row, K, xq, m0, y, ldy);
    case 4: return dot_row<4>(type, row, K, xq, m0, y, ldy);
    case 5: return dot_row<5>(type, row, K, xq, m0, y, ldy);
    case 6: return dot_row<6>(type, row, K, xq, m0, y, ldy);
    case 7: return dot_row<7>(type, row, K, xq, m0, y, ldy);
    default: return dot_row<8>(type, row, K, xq, m0, y, ldy);
  }
}

// ---------------------------------------------------------------------------------------------
// Every type above repacked sixteen rows at a time (a type id + kPacked), for CPUs with
// AVX512-VNNI (AVX2 reads the same groups, below). One 64-byte load holds 4 code bytes of each of 16 rows, so one vpdpbusd with 4
// bytes of x broadcast takes 16 rows' dot products at once, each row in its own int32 lane:
// the x bytes and the scale steps serve 16 rows, no lane sum is left to reduce at the end of a
// row, and the 16 outputs are stored in one go. llama.cpp's Q4_K_8x8 repack follows the same
// idea. The repack keeps every bit of the file's blocks (unpack_row gives them back exactly),
// and a packed group of a block takes 16 times the block's bytes. Per 16-row group and block,
// in order:
//   Q4_K: d fp16 [16] | dmin fp16 [16] | scales [3][16][4]: word i of row r is the file's 6-bit
//         scales and minimums, bytes 4i .. 4i + 3 (kept packed: unpacked, they took 64 more
//         bytes a group, ~3% more to read, against a few ops a block to unpack) |
//         qs [4 chunks][8][16][4]: byte t of group (c, j) of row r is the file's qs[32c + 4j + t]
//         (low nibble weight 64c + 4j + t, high nibble 64c + 32 + 4j + t).
//   Q5_K: Q4_K's fields, then qh [8][16][4]: byte t of group j of row r is the file's
//         qh[4j + t], whose bits 2c and 2c + 1 are the fifth bits of chunk c's two nibbles.
//   Q6_K: d fp16 [16] | sc i8 [8 pairs][16][2] | [2 halves n][8 j] of (qh, ql, ql') [16][4]:
//         byte t of row r is the file's qh[32n + 4j + t], ql[64n + 4j + t], ql[64n + 32 + 4j + t]
//         (the three a kernel step reads, side by side so that the block is read in order).
//   Q8_0: d fp16 [16] | codes + 128 as u8 [8][16][4] (weight 4j + t of the block).
//   Q4_0, Q4_1, Q5_0, Q5_1 (32 weights a block): d fp16 [16] | Q4_1 / Q5_1: m fp16 [16] |
//         Q5_0 / Q5_1: fifth bits u32 [16] | qs [4][16][4]: byte t of group j of row r is the
//         file's qs[4j + t] (low nibble weight 4j + t, high nibble 16 + 4j + t). A row's fifth
//         bits are reordered so that one shift puts a step's at bit 4 of its code bytes: bit
//         8t + j is weight 4j + t's, bit 8t + 4 + j weight 16 + 4j + t's.
constexpr int64_t kPacked = 256;
constexpr int64_t kGroup = 16;
constexpr int kPackedRowTile = 4;  // rows of x a pass over a packed group keeps in registers
// AVX2's Q6_K serves 8 rows a pass: decoding its 6-bit codes costs about two rows' products, so
// sharing one decode among 8 rows beats two passes of 4 even with accumulators spilled to L1.
// Q4_K, Q5_K and Q8_0 codes decode in an op or two and keep the 4-row tile.
constexpr int kQ6kRowTileAvx2 = 8;
constexpr int64_t kQ80PrefetchAhead = 4;  // Q8_0 blocks (8.5 lines each) between a prefetch and its use
constexpr int64_t kSmallPrefetchAhead = 4;  // Q4_0-Q5_1 blocks (4.5-6 lines each), likewise

inline bool is_packed(int64_t type) { return type >= kPacked; }
// Where a packed Q4_K / Q5_K block's scale words i (0-2) and its codes start.
constexpr int64_t k4_scales_at(int64_t i) { return 64 + 64 * i; }
constexpr int64_t kK4CodesAt = 256;
constexpr int64_t kQ4kGroupBytes = 2304;  // a packed Q4_K block of 16 rows; Q5_K's qh start there
constexpr int64_t kQ5kGroupBytes = 2816;
// A packed Q4_K (kQ5: Q5_K) block: its bytes, and its lines asked for ahead per chunk.
template <bool kQ5>
constexpr int64_t k4_group_bytes() { return kQ5 ? kQ5kGroupBytes : kQ4kGroupBytes; }
#if defined(__AVX2__)
template <bool kQ5>
inline void prefetch_k4_chunk(const uint8_t* in, int c) {  // 36 (Q5_K: 44) lines over 4 chunks
  prefetch_ahead<kQ5 ? 11 : 9>(in + (kQ5 ? 704 : 576) * c, k4_group_bytes<kQ5>());
}
#endif

int64_t packed_group_bytes(int64_t type) {  // one block of 16 rows
  switch (type) {
    case kQ4_K: return kQ4kGroupBytes;
    case kQ5_K: return kQ5kGroupBytes;
    case kQ6_K: return 3360;
    case kQ8_0: return 544;
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: return kGroup * type_info(type).bytes;
    default: return 0;
  }
}

// The small 4- and 5-bit types: whether a block has a minimum (Q4_1, Q5_1) and fifth bits (Q5_0,
// Q5_1), and where a packed block's fields start.
constexpr bool small_has_min(int64_t type) { return type == kQ4_1 || type == kQ5_1; }
constexpr bool small_has_fifth(int64_t type) { return type == kQ5_0 || type == kQ5_1; }
constexpr int64_t small_fifth_at(bool has_min) { return has_min ? 64 : 32; }
constexpr int64_t small_codes_at(bool has_min, bool fifth) { return small_fifth_at(has_min) + (fifth ? 64 : 0); }
inline bool is_small_type(int64_t type) { return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1; }

// A file block's 32 fifth bits (bit l: weight l) in the packed order (see above), and back.
inline uint32_t fifth_bits_packed(uint32_t qh) {
  uint32_t out = 0;
  for (int j = 0; j < 4; ++j) {
    for (int t = 0; t < 4; ++t) {
      out |= ((qh >> (4 * j + t)) & 1u) << (8 * t + j);
      out |= ((qh >> (16 + 4 * j + t)) & 1u) << (8 * t + 4 + j);
    }
  }
  return out;
}
inline uint32_t fifth_bits_file(uint32_t packed) {
  uint32_t qh = 0;
  for (int j = 0; j < 4; ++j) {
    for (int t = 0; t < 4; ++t) {
      qh |= ((packed >> (8 * t + j)) & 1u) << (4 * j + t);
      qh |= ((packed >> (8 * t + 4 + j)) & 1u) << (16 + 4 * j + t);
    }
  }
  return qh;
}

// Offset of group j (4 bytes a row, `per` groups a chunk) of chunk c, row r, in a packed area.
inline int64_t granule(int64_t per, int64_t c, int64_t j, int64_t r) { return ((per * c + j) * kGroup + r) * 4; }

// Offset of row r's 4 bytes of qh (i = 0), ql (1) or ql' (2) for step (n, j) of a packed Q6_K block.
inline int64_t q6_at(int64_t n, int64_t j, int64_t i, int64_t r) { return 288 + ((8 * n + j) * 3 + i) * 64 + 4 * r; }

// Rows [16 g, 16 g + 16) of `src` (row_bytes apart) into one packed group of `type`.
void repack_group(int64_t type, const uint8_t* src, int64_t row_bytes, int64_t K, uint8_t* dst) {
  const TypeInfo info = type_info(type);
  const int64_t gb = packed_group_bytes(type);
  for (int64_t b = 0; b < K / info.unit; ++b) {
    uint8_t* out = dst + b * gb;
    for (int64_t r = 0; r < kGroup; ++r) {
      const uint8_t* blk = src + r * row_bytes + b * info.bytes;
      if (is_small_type(type)) {
        const bool has_min = small_has_min(type), fifth = small_has_fifth(type);
        std::memcpy(out + 2 * r, blk, 2);
        if (has_min) std::memcpy(out + 32 + 2 * r, blk + 2, 2);
        const uint8_t* qs = blk + (has_min ? 4 : 2);
        if (fifth) {
          uint32_t qh;
          std::memcpy(&qh, qs, 4);
          qh = fifth_bits_packed(qh);
          std::memcpy(out + small_fifth_at(has_min) + 4 * r, &qh, 4);
          qs += 4;
        }
        for (int64_t j = 0; j < 4; ++j) std::memcpy(out + small_codes_at(has_min, fifth) + granule(4, 0, j, r), qs + 4 * j, 4);
      } else if (type == kQ8_0) {
        std::memcpy(out + 2 * r, blk, 2);
        for (int64_t j = 0; j < 8; ++j) {  // codes + 128: each byte's top bit flipped
          uint32_t v;
          std::memcpy(&v, blk + 2 + 4 * j, 4);
          v ^= 0x80808080u;
          std::memcpy(out + granule(8, 0, j, r) + 32, &v, 4);
        }
      } else if (type == kQ4_K || type == kQ5_K) {
        std::memcpy(out + 2 * r, blk, 2);
        std::memcpy(out + 32 + 2 * r, blk + 2, 2);
        for (int64_t i = 0; i < 3; ++i) std::memcpy(out + k4_scales_at(i) + 4 * r, blk + 4 + 4 * i, 4);
        const uint8_t* qs = blk + (type == kQ5_K ? 48 : 16);
        for (int64_t c = 0; c < 4; ++c) {
          for (int64_t j = 0; j < 8; ++j) std::memcpy(out + kK4CodesAt + granule(8, c, j, r), qs + 32 * c + 4 * j, 4);
        }
        if (type == kQ5_K) {
          for (int64_t j = 0; j < 8; ++j) std::memcpy(out + kQ4kGroupBytes + granule(8, 0, j, r), blk + 16 + 4 * j, 4);
        }
      } else {  // Q6_K
        std::memcpy(out + 2 * r, blk + 208, 2);
        for (int s = 0; s < 16; ++s) out[32 + ((s / 2) * kGroup + r) * 2 + s % 2] = blk[192 + s];
        for (int64_t n = 0; n < 2; ++n) {
          for (int64_t j = 0; j < 8; ++j) {
            std::memcpy(out + q6_at(n, j, 0, r), blk + 128 + 32 * n + 4 * j, 4);
            std::memcpy(out + q6_at(n, j, 1, r), blk + 64 * n + 4 * j, 4);
            std::memcpy(out + q6_at(n, j, 2, r), blk + 64 * n + 32 + 4 * j, 4);
          }
        }
      }
    }
  }
}

// Row r of a packed group back in the file's blocks (row_bytes of them).
void unpack_row(int64_t type, const uint8_t* group, int64_t K, int64_t r, uint8_t* row) {
  const TypeInfo info = type_info(type);
  const int64_t gb = packed_group_bytes(type);
  for (int64_t b = 0; b < K / info.unit; ++b) {
    const uint8_t* in = group + b * gb;
    uint8_t* blk = row + b * info.bytes;
    if (is_small_type(type)) {
      const bool has_min = small_has_min(type), fifth = small_has_fifth(type);
      std::memcpy(blk, in + 2 * r, 2);
      if (has_min) std::memcpy(blk + 2, in + 32 + 2 * r, 2);
      uint8_t* qs = blk + (has_min ? 4 : 2);
      if (fifth) {
        uint32_t packed;
        std::memcpy(&packed, in + small_fifth_at(has_min) + 4 * r, 4);
        const uint32_t qh = fifth_bits_file(packed);
        std::memcpy(qs, &qh, 4);
        qs += 4;
      }
      for (int64_t j = 0; j < 4; ++j) std::memcpy(qs + 4 * j, in + small_codes_at(has_min, fifth) + granule(4, 0, j, r), 4);
    } else if (type == kQ8_0) {
      std::memcpy(blk, in + 2 * r, 2);
      for (int64_t e = 0; e < 32; ++e) blk[2 + e] = in[32 + (e / 4 * kGroup + r) * 4 + e % 4] ^ 0x80;
    } else if (type == kQ4_K || type == kQ5_K) {
      std::memcpy(blk, in + 2 * r, 2);
      std::memcpy(blk + 2, in + 32 + 2 * r, 2);
      for (int64_t i = 0; i < 3; ++i) std::memcpy(blk + 4 + 4 * i, in + k4_scales_at(i) + 4 * r, 4);
      uint8_t* qs = blk + (type == kQ5_K ? 48 : 16);
      for (int64_t c = 0; c < 4; ++c) {
        for (int64_t j = 0; j < 8; ++j) std::memcpy(qs + 32 * c + 4 * j, in + kK4CodesAt + granule(8, c, j, r), 4);
      }
      if (type == kQ5_K) {
        for (int64_t j = 0; j < 8; ++j) std::memcpy(blk + 16 + 4 * j, in + kQ4kGroupBytes + granule(8, 0, j, r), 4);
      }
    } else {  // Q6_K
      std::memcpy(blk + 208, in + 2 * r, 2);
      for (int s = 0; s < 16; ++s) blk[192 + s] = in[32 + ((s / 2) * kGroup + r) * 2 + s % 2];
      for (int64_t n = 0; n < 2; ++n) {
        for (int64_t j = 0; j < 8; ++j) {
          std::memcpy(blk + 128 + 32 * n + 4 * j, in + q6_at(n, j, 0, r), 4);
          std::memcpy(blk + 64 * n + 4 * j, in + q6_at(n, j, 1, r), 4);
          std::memcpy(blk + 64 * n + 32 + 4 * j, in + q6_at(n, j, 2, r), 4);
        }
      }
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)

inline __m512i bcast4(const int8_t* p) {  // 4 bytes of x in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 halves16(const uint8_t* p) {  // 16 fp16 values to fp32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The three kernels below take a weight vector once and then meet it with every row of x
// before the next: each row has its own accumulators, so consecutive dot products do not wait
// on each other (a dependent chain of vpdpbusd runs at its latency, several cycles each, and
// leaves the vector units mostly idle at 4 rows). Integer sums are exact, and each row's float
// steps come in the same order whatever MR is, so a row's result does not depend on its tile.

// The 6-bit scales and minimums of 16 rows' Q4_K / Q5_K blocks, unpacked from their file form
// (k4_scales_mins on every row at once): byte s of lane r of sc[h] is row r's scale of
// sub-block 4h + s, and mn[h] holds the minimums likewise.
__attribute__((target("avx512f,avx512bw"))) inline void k4_scales16(const uint8_t* in, __m512i sc[2], __m512i mn[2]) {
  const __m512i w0 = _mm512_loadu_si512(in + k4_scales_at(0)), w1 = _mm512_loadu_si512(in + k4_scales_at(1)),
                w2 = _mm512_loadu_si512(in + k4_scales_at(2));
  const __m512i m6 = _mm512_set1_epi8(0x3F), m4 = _mm512_set1_epi8(0xF), top = _mm512_set1_epi8(0x30);
  sc[0] = _mm512_and_si512(w0, m6);
  mn[0] = _mm512_and_si512(w1, m6);
  // A byte's top two bits land at bits 4-5 of the same byte after a 16-bit shift by 2.
  sc[1] = _mm512_or_si512(_mm512_and_si512(w2, m4), _mm512_and_si512(_mm512_srli_epi16(w0, 2), top));
  mn[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w2, 4), m4), _mm512_and_si512(_mm512_srli_epi16(w1, 2), top));
}

// vpshufb controls that take, in each 32-bit lane, byte s as an int32 (byte_lane) or bytes s and
// s + 1 as the two int16 halves (pair_lanes): a packed K-quant's per-row scales into the
// lanes the dot products sum in.
inline __m512i byte_lane(int s) {
  const int b = s | 0x80808000;
  return _mm512_set4_epi32(b + 12, b + 8, b + 4, b);
}
inline __m512i pair_lanes(int s) {
  const int b = s | ((s + 1) << 16) | static_cast<int>(0x80008000u);
  const int step = 4 | (4 << 16);
  return _mm512_set4_epi32(b + 3 * step, b + 2 * step, b + step, b);
}

// Rows [m0, m0 + MR) of x against a packed group of 16 outputs, into y[m * ldy + 0 .. 15].
// Per super-block: int32 sums of each sub-block times its scale, then one float step with
// d * dx (x quantized per 256 as llama.cpp's q8_K), as the unpacked K-quant path does.
// kQ5: Q5_K, whose fifth bits (qh) join each chunk's nibbles.
template <int MR, bool kQ5>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
void packed_q4k(const uint8_t* group, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t kBytes = k4_group_bytes<kQ5>();
  const __m512i m4 = _mm512_set1_epi8(0xF), fifth = _mm512_set1_epi8(0x10);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* in = group + b * kBytes;
    if constexpr (MR == 1) touch_lines<4>(in);  // d, dmin, scales and mins: bytes [0, 256)
    __m512i sc[2], mn[2];
    k4_scales16(in, sc, mn);
    __m512i isum[MR], imin[MR];
    for (int m = 0; m < MR; ++m) isum[m] = imin[m] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      if constexpr (MR > 1) prefetch_k4_chunk<kQ5>(in, c);
      const int8_t* q[MR];
      __m512i a0[MR], a1[MR];
      for (int m = 0; m < MR; ++m) {
        q[m] = xq.q256.data() + (m0 + m) * xq.Kp + 256 * b + 64 * c;
        a0[m] = a1[m] = _mm512_setzero_si512();
      }
      for (int j = 0; j < 8; ++j) {
        const __m512i v = _mm512_loadu_si512(in + kK4CodesAt + granule(8, c, j, 0));
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if constexpr (kQ5) {  // bits 2c and 2c + 1 of qh to bit 4 of lo and hi
          const __m512i h = _mm512_srl_epi16(_mm512_loadu_si512(in + kQ4kGroupBytes + granule(8, 0, j, 0)), _mm_cvtsi32_si128(2 * c));
          lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(h, 4), fifth));
          hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(h, 3), fifth));
        }
        for (int m = 0; m < MR; ++m) {
          a0[m] = _mm512_dpbusd_epi32(a0[m], lo, bcast4(q[m] + 4 * j));
          a1[m] = _mm512_dpbusd_epi32(a1[m], hi, bcast4(q[m] + 32 + 4 * j));
        }
      }
      // Sub-blocks 2c and 2c + 1: bytes s and s + 1 of word c / 2.
      const int s = 2 * (c % 2);
      const __m512i sc_lo = _mm512_shuffle_epi8(sc[c / 2], byte_lane(s));
      const __m512i sc_hi = _mm512_shuffle_epi8(sc[c / 2], byte_lane(s + 1));
      const __m512i mins = _mm512_shuffle_epi8(mn[c / 2], pair_lanes(s));
      for (int m = 0; m < MR; ++m) {
        isum[m] = _mm512_add_epi32(isum[m], _mm512_add_epi32(_mm512_mullo_epi32(a0[m], sc_lo), _mm512_mullo_epi32(a1[m], sc_hi)));
        int32_t pair;  // the sums of x over sub-blocks 2c and 2c + 1, as two int16
        std::memcpy(&pair, xq.sum32.data() + ((m0 + m) * xq.Kp + 256 * b) / 32 + 2 * c, 4);
        imin[m] = _mm512_dpwssd_epi32(imin[m], mins, _mm512_set1_epi32(pair));
      }
    }
    const __m512 d = halves16(in), dmin = halves16(in + 32);
    for (int m = 0; m < MR; ++m) {
      const __m512 dx = _mm512_set1_ps(xq.d256[((m0 + m) * xq.Kp) / 256 + b]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, dx), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin[m]), _mm512_mul_ps(dmin, dx), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy, acc[m]);
}

// Q6_K: ql byte 64n + l holds the low 4 bits of weights 128n + l (low nibble) and 128n + 64 + l
// (high); qh byte 32n + l the top 2 bits of 128n + l + 32 i at bits 2i. Scales per 16 weights.
// A step's three loads give four 64-byte code vectors (i = 0..3, weights 32 i apart), each
// met with every row in its own accumulator: 4 * MR independent sums.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
void packed_q6k(const uint8_t* group, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* in = group + b * 3360;
    if constexpr (MR == 1) touch_lines<5>(in);  // d and the scales: bytes [0, 288)
    __m512i isum[MR], corr[MR];
    for (int m = 0; m < MR; ++m) isum[m] = corr[m] = _mm512_setzero_si512();
    for (int n = 0; n < 2; ++n) {
      for (int h = 0; h < 2; ++h) {  // weights 128n + 32i + 16h + [0, 16), group 8n + 2i + h
        if constexpr (MR > 1) prefetch_ahead<14>(in + 896 * (2 * n + h), 3360);  // a block's 53 lines over 4 steps
        const int8_t* q[MR];
        __m512i a[MR][4];
        for (int m = 0; m < MR; ++m) {
          q[m] = xq.q256.data() + (m0 + m) * xq.Kp + 256 * b + 128 * n + 16 * h;
          for (int i = 0; i < 4; ++i) a[m][i] = _mm512_setzero_si512();
        }
        // Unrolled, so that the 4 * MR sums stay in registers: left as a loop at 4 rows, GCC
        // kept them in memory and every vpdpbusd waited on a store and a load.
#pragma GCC unroll 4
        for (int jj = 0; jj < 4; ++jj) {
          const int j = 4 * h + jj;
          const __m512i hb = _mm512_loadu_si512(in + q6_at(n, j, 0, 0));
          const __m512i l0 = _mm512_loadu_si512(in + q6_at(n, j, 1, 0));
          const __m512i l1 = _mm512_loadu_si512(in + q6_at(n, j, 2, 0));
          const __m512i codes[4] = {
              _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 4), m30)),
              _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 2), m30)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_and_si512(hb, m30)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4), _mm512_and_si512(_mm512_srli_epi16(hb, 2), m30))};
          for (int m = 0; m < MR; ++m) {
            for (int i = 0; i < 4; ++i) a[m][i] = _mm512_dpbusd_epi32(a[m][i], codes[i], bcast4(q[m] + 32 * i + 4 * jj));
          }
        }
        for (int i = 0; i < 4; ++i) {
          // Scales of groups 8n + 2i (low int16 of each lane) and 8n + 2i + 1 (high), as int32.
          const __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 32 + 32 * (4 * n + i))));
          const __m512i sc = h == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16) : _mm512_srai_epi32(pair, 16);
          for (int m = 0; m < MR; ++m) isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(a[m][i], sc));
          if (h == 1) {
            for (int m = 0; m < MR; ++m) {
              int32_t sums;  // x's sums over groups 8n + 2i and 8n + 2i + 1, as int16 pairs like `pair`
              std::memcpy(&sums, xq.sum16.data() + ((m0 + m) * xq.Kp + 256 * b) / 16 + 8 * n + 2 * i, 4);
              corr[m] = _mm512_dpwssd_epi32(corr[m], pair, _mm512_set1_epi32(sums));
            }
          }
        }
      }
    }
    const __m512 d = halves16(in);
    for (int m = 0; m < MR; ++m) {  // codes are the weights + 32: sum(sc * (code - 32) * x)
      const __m512i total = _mm512_sub_epi32(isum[m], _mm512_slli_epi32(corr[m], 5));
      const __m512 dx = _mm512_set1_ps(xq.d256[((m0 + m) * xq.Kp) / 256 + b]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, dx), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy, acc[m]);
}

// Q8_0 against x quantized per 32 (codes are stored + 128: sum((w + 128) * qx) - 128 sum(qx)).
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
void packed_q80(const uint8_t* group, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* in = group + b * 544;
    if constexpr (MR > 1) {
      prefetch_lines<9>(in + kQ80PrefetchAhead * 544);
      prefetch_l2<9>(in + l2_ahead(544) + kQ80PrefetchAhead * 544);
    }
    const int8_t* q[MR];
    __m512i a0[MR], a1[MR];
    for (int m = 0; m < MR; ++m) {
      q[m] = xq.q.data() + (m0 + m) * xq.Kp + 32 * b;
      a0[m] = a1[m] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 8; j += 2) {
      const __m512i w0 = _mm512_loadu_si512(in + 32 + 64 * j), w1 = _mm512_loadu_si512(in + 96 + 64 * j);
      for (int m = 0; m < MR; ++m) {
        a0[m] = _mm512_dpbusd_epi32(a0[m], w0, bcast4(q[m] + 4 * j));
        a1[m] = _mm512_dpbusd_epi32(a1[m], w1, bcast4(q[m] + 4 * j + 4));
      }
    }
    const __m512 d = halves16(in);
    for (int m = 0; m < MR; ++m) {
      const int64_t base = (m0 + m) * xq.Kp + 32 * b;
      const float dx = xq.dx4[base / 4];
      const float off = 128.f * (xq.sums[base / 16] + xq.sums[base / 16 + 1]);  // dx * 128 * sum(qx)
      const __m512 dot = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0[m], a1[m])), _mm512_set1_ps(dx), _mm512_set1_ps(off));
      acc[m] = _mm512_fmadd_ps(dot, d, acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy, acc[m]);
}

// Q4_0, Q4_1, Q5_0, Q5_1 against x quantized per 32. Their codes are unsigned (0-15, or 0-31
// with the fifth bit), as vpdpbusd takes them: Q4_0 / Q5_0 weigh d * (code - 8 or 16), so a
// block's dot product is d * (dx * sum(code * qx) - 8 or 16 times dx * sum(qx)); Q4_1 / Q5_1
// weigh d * code + m, so it is d * dx * sum(code * qx) + m * dx * sum(qx).
template <int MR, bool kMin, bool kFifth>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
void packed_small(const uint8_t* group, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t kBytes = small_codes_at(kMin, kFifth) + 256, kCodes = small_codes_at(kMin, kFifth);
  constexpr int64_t kLines = (kBytes + 63) / 64;
  const __m512i m4 = _mm512_set1_epi8(0xF), fifth = _mm512_set1_epi8(0x10);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* in = group + b * kBytes;
    if constexpr (MR > 1) {
      prefetch_lines<kLines>(in + kSmallPrefetchAhead * kBytes);
      prefetch_l2<kLines>(in + l2_ahead(kBytes) + kSmallPrefetchAhead * kBytes);
    }
    const int8_t* q[MR];
    __m512i a0[MR], a1[MR];
    for (int m = 0; m < MR; ++m) {
      q[m] = xq.q.data() + (m0 + m) * xq.Kp + 32 * b;
      a0[m] = a1[m] = _mm512_setzero_si512();
    }
    const __m512i qh = kFifth ? _mm512_loadu_si512(in + small_fifth_at(kMin)) : _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(in + kCodes + 64 * j);
      __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      if constexpr (kFifth) {  // lo | (shifted & 0x10), one op each
        lo = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi32(qh, 4 - j), fifth, 0xF8);
        hi = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi32(qh, j), fifth, 0xF8);
      }
      for (int m = 0; m < MR; ++m) {
        a0[m] = _mm512_dpbusd_epi32(a0[m], lo, bcast4(q[m] + 4 * j));
        a1[m] = _mm512_dpbusd_epi32(a1[m], hi, bcast4(q[m] + 16 + 4 * j));
      }
    }
    const __m512 d = halves16(in);
    for (int m = 0; m < MR; ++m) {
      const int64_t base = (m0 + m) * xq.Kp + 32 * b;
      const float dx = xq.dx4[base / 4], sx = xq.sums[base / 16] + xq.sums[base / 16 + 1];  // sx: dx * sum(qx)
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a0[m], a1[m]));
      if constexpr (kMin) {
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(dx)), d, acc[m]);
        acc[m] = _mm512_fmadd_ps(halves16(in + 32), _mm512_set1_ps(sx), acc[m]);
      } else {
        const float off = (kFifth ? 16.f : 8.f) * sx;
        acc[m] = _mm512_fmadd_ps(_mm512_fmsub_ps(dot, _mm512_set1_ps(dx), _mm512_set1_ps(off)), d, acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy, acc[m]);
}

template <int MR>
void packed_tile(int64_t type, const uint8_t* group, int64_t K, const QuantizedX& xq, int64_t m0, float* y, int64_t ldy) {
  switch (type) {
    case kQ4_K: return packed_q4k<MR, false>(group, K, xq, m0, y, ldy);
    case kQ5_K: return packed_q4k<MR, true>(group, K, xq, m0, y, ldy);
    case kQ6_K: return packed_q6k<MR>(group, K, xq, m0, y, ldy);
    case kQ4_0: return packed_small<MR, false, false>(group, K, xq, m0, y, ldy);
    case kQ4_1: return packed_small<MR, true, false>(group, K, xq, m0, y, ldy);
    case kQ5_0: return packed_small<MR, false, true>(group, K, xq, m0, y, ldy);
    case kQ5_1: return packed_small<MR, true, true>(group, K, xq, m0, y, ldy);
    default: return packed_q80<MR>(group, K, xq, m0, y, ldy);
  }
}

#endif

#if defined(__AVX2__)
// The packed groups read with AVX2 (no int8 dot-product instruction). A 32-byte load holds 4
// code bytes of 8 rows, half a group's 64, so a group is read as two halves of 8 outputs.
// vpmaddubsw of the codes with 4 bytes of x broadcast gives each row two int16 pair sums;
// these add up in int16 over as many steps as the codes' width allows (Q4_K: a whole 32-weight
// sub-block; Q5_K: half of one; Q6_K: two steps) and then meet the rows' scales in one vpmaddwd, which also widens
// them to int32. A product a row at a time widens once per 32 weights of every row; here one
// widening serves 8 rows and several steps. Q8_0's codes are too wide for int16 sums and widen
// every step, but its float step per block still serves 8 rows.

inline __m256i bcast4_256(const int8_t* p) {  // 4 bytes of x in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The 6-bit scales (mins = false) or minimums of sub-blocks 4h .. 4h + 3 of 8 rows' packed
// Q4_K / Q5_K blocks (rows 8 hf on), byte s of each row's lane for sub-block 4h + s: k4_scales16
// for a half group.
inline __m256i k4_scales8(const uint8_t* in, int hf, int h, bool mins) {
  const __m256i own = load32(in + k4_scales_at(mins ? 1 : 0) + 32 * hf);
  if (h == 0) return _mm256_and_si256(own, _mm256_set1_epi8(0x3F));
  const __m256i w2 = load32(in + k4_scales_at(2) + 32 * hf);
  const __m256i low = mins ? _mm256_srli_epi16(w2, 4) : w2;
  return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0xF)),
                         _mm256_and_si256(_mm256_srli_epi16(own, 2), _mm256_set1_epi8(0x30)));
}

// vpshufb controls as byte_lane and pair_lanes above: byte s of each 32-bit lane into both its
// int16 halves (a row's scale for vpmaddwd), or bytes s and s + 1 into the two halves.
inline __m256i byte_both_halves(int s) {
  const int b = s | (s << 16) | static_cast<int>(0x80008000u), step = 4 | (4 << 16);
  return _mm256_setr_epi32(b, b + step, b + 2 * step, b + 3 * step, b, b + step, b + 2 * step, b + 3 * step);
}
inline __m256i pair_halves(int s) { return _mm256_add_epi32(byte_both_halves(s), _mm256_set1_epi32(1 << 16)); }

inline __m256 halves8(const uint8_t* p) {  // 8 fp16 values to fp32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Block b of rows [m0, m0 + MR) of x against NH halves from `hf0` (half hf: outputs 8 hf ..
// 8 hf + 7) of a packed Q4_K (kQ5: Q5_K) group, added to acc [NH][MR]. One row takes both
// halves in one pass, whose independent sums keep more of the core busy; more rows take a
// half at a time, as their sums and scales would not fit AVX2's 16 registers twice.
template <int MR, bool kQ5, int NH>
inline void q4k_block_halves(const uint8_t* in, int64_t b, int hf0, const QuantizedX& xq, int64_t m0, __m256* acc) {
  // Steps whose pair sums share an int16: 15 * 127 * 2 a step for 4-bit codes, 31 * 127 * 2 for 5.
  constexpr int kSteps = kQ5 ? 4 : 8;
  const __m256i m4 = _mm256_set1_epi8(0xF), fifth = _mm256_set1_epi8(0x10);
  __m256i isum[NH][MR], imin[NH][MR];
  for (int h = 0; h < NH; ++h) {
    for (int m = 0; m < MR; ++m) isum[h][m] = imin[h][m] = _mm256_setzero_si256();
  }
  for (int c = 0; c < 4; ++c) {
    const int8_t* q[MR];
    __m256i a0[NH][MR], a1[NH][MR];  // int16: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    for (int m = 0; m < MR; ++m) {
      q[m] = xq.q256.data() + (m0 + m) * xq.Kp + 256 * b + 64 * c;
      for (int h = 0; h < NH; ++h) a0[h][m] = a1[h][m] = _mm256_setzero_si256();
    }
    // As packed_q4k asks (at one row too: the AVX2 kernels' steps are long there as well);
    // half 1 reads what half 0 did.
    if (hf0 == 0) prefetch_k4_chunk<kQ5>(in, c);
    __m256i sc_lo[NH], sc_hi[NH];
    const int s = 2 * (c % 2);  // sub-blocks 2c and 2c + 1: bytes s and s + 1 of word c / 2
    for (int h = 0; h < NH; ++h) {
      const __m256i sc = k4_scales8(in, hf0 + h, c / 2, false);
      sc_lo[h] = _mm256_shuffle_epi8(sc, byte_both_halves(s));
      sc_hi[h] = _mm256_shuffle_epi8(sc, byte_both_halves(s + 1));
    }
    for (int j = 0; j < 8; ++j) {
      for (int h = 0; h < NH; ++h) {
        const int64_t hf = hf0 + h;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + kK4CodesAt + granule(8, c, j, 8 * hf)));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if constexpr (kQ5) {  // bits 2c and 2c + 1 of qh to bit 4 of lo and hi
          const __m256i hb = _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + kQ4kGroupBytes + granule(8, 0, j, 8 * hf))),
                                              _mm_cvtsi32_si128(2 * c));
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), fifth));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 3), fifth));
        }
        for (int m = 0; m < MR; ++m) {
          a0[h][m] = _mm256_add_epi16(a0[h][m], _mm256_maddubs_epi16(lo, bcast4_256(q[m] + 4 * j)));
          a1[h][m] = _mm256_add_epi16(a1[h][m], _mm256_maddubs_epi16(hi, bcast4_256(q[m] + 32 + 4 * j)));
        }
      }
      if ((j + 1) % kSteps == 0) {
        for (int h = 0; h < NH; ++h) {
          for (int m = 0; m < MR; ++m) {
            isum[h][m] = _mm256_add_epi32(isum[h][m], _mm256_add_epi32(_mm256_madd_epi16(a0[h][m], sc_lo[h]),
                                                                       _mm256_madd_epi16(a1[h][m], sc_hi[h])));
            a0[h][m] = a1[h][m] = _mm256_setzero_si256();
          }
        }
      }
    }
    for (int h = 0; h < NH; ++h) {
      const __m256i mins = _mm256_shuffle_epi8(k4_scales8(in, hf0 + h, c / 2, true), pair_halves(s));
      for (int m = 0; m < MR; ++m) {
        int32_t pair;  // the sums of x over sub-blocks 2c and 2c + 1, as two int16
        std::memcpy(&pair, xq.sum32.data() + ((m0 + m) * xq.Kp + 256 * b) / 32 + 2 * c, 4);
        imin[h][m] = _mm256_add_epi32(imin[h][m], _mm256_madd_epi16(mins, _mm256_set1_epi32(pair)));
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m256 d = halves8(in + 16 * (hf0 + h)), dmin = halves8(in + 32 + 16 * (hf0 + h));
    for (int m = 0; m < MR; ++m) {
      const __m256 dx = _mm256_set1_ps(xq.d256[((m0 + m) * xq.Kp) / 256 + b]);
      __m256& a = acc[h * MR + m];
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][m]), _mm256_mul_ps(d, dx), a);
      a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[h][m]), _mm256_mul_ps(dmin, dx), a);
    }
  }
}

// Code vector I (weights 32 I apart, as packed_q6k's) of step (n, j), half hf, of a packed Q6_K block.
template <int I>
inline __m256i q6_codes_half(const uint8_t* in, int n, int j, int hf) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + q6_at(n, j, 0, 8 * hf)));
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + q6_at(n, j, 1 + I % 2, 8 * hf)));
  const __m256i low = I < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
  const __m256i high = I == 0 ? _mm256_slli_epi16(hb, 4) : I == 1 ? _mm256_slli_epi16(hb, 2) : I == 2 ? hb : _mm256_srli_epi16(hb, 2);
  return _mm256_or_si256(low, _mm256_and_si256(high, m30));
}

// Groups 8n + 2I and 8n + 2I + 1 of a packed Q6_K block's half hf, for rows [m0, m0 + MR):
// isum += their scales times the codes' dot products, corr += their scales times x's sums.
template <int MR, int I>
inline void q6_groups_half(const uint8_t* in, int n, int hf, const int8_t* const* q, const int16_t* const* sum16,
                           __m256i* isum, __m256i* corr) {
  // The two groups' scales, an int16 pair per row; each spread over both halves of the row's lane.
  const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 32 + 32 * (4 * n + I) + 16 * hf)));
  const __m256i sc[2] = {_mm256_blend_epi16(pair, _mm256_slli_epi32(pair, 16), 0xAA),
                         _mm256_blend_epi16(_mm256_srli_epi32(pair, 16), pair, 0xAA)};
  if (hf == 0) prefetch_ahead<7>(in + 448 * (4 * n + I), 3360);  // a block's 53 lines over 8 calls
  for (int j = 0; j < 8; j += 2) {  // group 8n + 2I + j / 4: weights 128n + 32I + 4j ..
    const __m256i c0 = q6_codes_half<I>(in, n, j, hf), c1 = q6_codes_half<I>(in, n, j + 1, hf);
    for (int m = 0; m < MR; ++m) {
      const int8_t* x = q[m] + 128 * n + 32 * I + 4 * j;
      const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(c0, bcast4_256(x)), _mm256_maddubs_epi16(c1, bcast4_256(x + 4)));
      isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(t, sc[j / 4]));
    }
  }
  for (int m = 0; m < MR; ++m) {
    int32_t sums;  // x's sums over the two groups, as int16 pairs like `pair`
    std::memcpy(&sums, sum16[m] + 8 * n + 2 * I, 4);
    corr[m] = _mm256_add_epi32(corr[m], _mm256_madd_epi16(pair, _mm256_set1_epi32(sums)));
  }
}

// Block b of rows [m0, m0 + MR) of x against half `hf` of a packed Q6_K group, added to acc.
// Its codes reach 63, so two steps' pair sums at most share an int16 before they meet their 16
// weights' scale.
template <int MR>
inline void q6k_block_half(const uint8_t* in, int64_t b, int hf, const QuantizedX& xq, int64_t m0, __m256* acc) {
  __m256i isum[MR], corr[MR];
  const int8_t* q[MR];
  const int16_t* sum16[MR];
  for (int m = 0; m < MR; ++m) {
    isum[m] = corr[m] = _mm256_setzero_si256();
    q[m] = xq.q256.data() + (m0 + m) * xq.Kp + 256 * b;
    sum16[m] = xq.sum16.data() + ((m0 + m) * xq.Kp + 256 * b) / 16;
  }
  for (int n = 0; n < 2; ++n) {
    q6_groups_half<MR, 0>(in, n, hf, q, sum16, isum, corr);
    q6_groups_half<MR, 1>(in, n, hf, q, sum16, isum, corr);
    q6_groups_half<MR, 2>(in, n, hf, q, sum16, isum, corr);
    q6_groups_half<MR, 3>(in, n, hf, q, sum16, isum, corr);
  }
  const __m256 d = halves8(in + 16 * hf);
  for (int m = 0; m < MR; ++m) {  // codes are the weights + 32: sum(sc * (code - 32) * x)
    const __m256i total = _mm256_sub_epi32(isum[m], _mm256_slli_epi32(corr[m], 5));
    const __m256 dx = _mm256_set1_ps(xq.d256[((m0 + m) * xq.Kp) / 256 + b]);
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[m]);
  }
}

// Block b of rows [m0, m0 + MR) of x (quantized per 32) against both halves of a packed Q8_0
// group, added to acc[0] (outputs 0-7) and acc[1] (8-15). Its codes, stored + 128 for vpdpbusd,
// are signed again here: a code times x is |code| times x with the code's sign, whose pair sums
// stay within int16 where (code + 128) times x would not. Q8_0 has no sub-block scales, so
// the two halves need only 2 * MR accumulators and each broadcast of x serves both (the other
// types take a half at a time: their int16 sums and scales would not fit AVX2's 16 registers).
template <int MR>
inline void q80_block(const uint8_t* in, int64_t b, const QuantizedX& xq, int64_t m0, __m256* acc0, __m256* acc1) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  prefetch_lines<9>(in + kQ80PrefetchAhead * 544);
  if constexpr (MR > 1) prefetch_l2<9>(in + l2_ahead(544) + kQ80PrefetchAhead * 544);  // one row keeps up without
  __m256i isum0[MR], isum1[MR];
  const int8_t* q[MR];
  for (int m = 0; m < MR; ++m) {
    isum0[m] = isum1[m] = _mm256_setzero_si256();
    q[m] = xq.q.data() + (m0 + m) * xq.Kp + 32 * b;
  }
  for (int j = 0; j < 8; ++j) {
    const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 32 + 64 * j)), flip);
    const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 64 + 64 * j)), flip);
    const __m256i wabs0 = _mm256_abs_epi8(w0), wabs1 = _mm256_abs_epi8(w1);  // -128 reads as 128 unsigned
    for (int m = 0; m < MR; ++m) {
      const __m256i x = bcast4_256(q[m] + 4 * j);
      isum0[m] = _mm256_add_epi32(isum0[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs0, _mm256_sign_epi8(x, w0)), ones));
      isum1[m] = _mm256_add_epi32(isum1[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs1, _mm256_sign_epi8(x, w1)), ones));
    }
  }
  const __m256 d0 = halves8(in), d1 = halves8(in + 16);
  for (int m = 0; m < MR; ++m) {
    const __m256 dx = _mm256_set1_ps(xq.dx4[((m0 + m) * xq.Kp + 32 * b) / 4]);
    acc0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum0[m]), _mm256_mul_ps(d0, dx), acc0[m]);
    acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum1[m]), _mm256_mul_ps(d1, dx), acc1[m]);
  }
}

// Block b of rows [m0, m0 + MR) of x (quantized per 32) against both halves of a packed Q4_0,
// Q4_1, Q5_0 or Q5_1 group (see packed_small), added to acc[0] (outputs 0-7) and acc[1]
// (8-15). The unsigned codes go into vpmaddubsw as they are; their int16 pair sums add up over
// the block's 4 steps (at most 8 * 31 * 127, within int16) before one widening a row and half.
template <int MR, bool kMin, bool kFifth>
inline void small_block(const uint8_t* in, int64_t b, const QuantizedX& xq, int64_t m0, __m256* acc0, __m256* acc1) {
  constexpr int64_t kBytes = small_codes_at(kMin, kFifth) + 256, kCodes = small_codes_at(kMin, kFifth);
  constexpr int64_t kLines = (kBytes + 63) / 64;
  const __m256i m4 = _mm256_set1_epi8(0xF), fifth = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  prefetch_lines<kLines>(in + kSmallPrefetchAhead * kBytes);
  if constexpr (MR > 1) prefetch_l2<kLines>(in + l2_ahead(kBytes) + kSmallPrefetchAhead * kBytes);
  const int8_t* q[MR];
  for (int m = 0; m < MR; ++m) q[m] = xq.q.data() + (m0 + m) * xq.Kp + 32 * b;
  for (int hf = 0; hf < 2; ++hf) {
    __m256i lo16[MR], hi16[MR];
    for (int m = 0; m < MR; ++m) lo16[m] = hi16[m] = _mm256_setzero_si256();
    const __m256i qh = kFifth ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + small_fifth_at(kMin) + 32 * hf))
                              : _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + kCodes + 64 * j + 32 * hf));
      __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if constexpr (kFifth) {
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32(qh, 4 - j), fifth));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi32(qh, j), fifth));
      }
      for (int m = 0; m < MR; ++m) {
        lo16[m] = _mm256_add_epi16(lo16[m], _mm256_maddubs_epi16(lo, bcast4_256(q[m] + 4 * j)));
        hi16[m] = _mm256_add_epi16(hi16[m], _mm256_maddubs_epi16(hi, bcast4_256(q[m] + 16 + 4 * j)));
      }
    }
    const __m256 d = halves8(in + 16 * hf);
    __m256* acc = hf == 0 ? acc0 : acc1;
    for (int m = 0; m < MR; ++m) {
      const int64_t base = (m0 + m) * xq.Kp + 32 * b;
      const float dx = xq.dx4[base / 4], sx = xq.sums[base / 16] + xq.sums[base / 16 + 1];  // sx: dx * sum(qx)
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(lo16[m], ones), _mm256_madd_epi16(hi16[m], ones)));
      if constexpr (kMin) {
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dot, _mm256_set1_ps(dx)), d, acc[m]);
        acc[m] = _mm256_fmadd_ps(halves8(in + 32 + 16 * hf), _mm256_set1_ps(sx), acc[m]);
      } else {
        const float off = (kFifth ? 16.f : 8.f) * sx;
        acc[m] = _mm256_fmadd_ps(_mm256_fmsub_ps(dot, _mm256_set1_ps(dx), _mm256_set1_ps(off)), d, acc[m]);
      }
    }
  }
}

// Rows [m0, m0 + MR) of x against a packed group, into y[m * ldy + 0 .. 15]: a block's
// two halves one after the other, so that the group is read once, in order.
template <int MR>
void packed_tile_avx2(int64_t type, const uint8_t* group, int64_t K, const QuantizedX& xq, int64_t m0, float* y,
                      int64_t ldy) {
  __m256 acc[2][MR];
  for (int m = 0; m < MR; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  const int64_t blocks = K / type_info(type).unit, bytes = packed_group_bytes(type);
  for (int64_t b = 0; b < blocks; ++b) {
    if (type == kQ8_0) {
      q80_block<MR>(group + b * bytes, b, xq, m0, acc[0], acc[1]);
      continue;
    }
    if (is_small_type(type)) {
      const uint8_t* in = group + b * bytes;
      switch (type) {
        case kQ4_0: small_block<MR, false, false>(in, b, xq, m0, acc[0], acc[1]); break;
        case kQ4_1: small_block<MR, true, false>(in, b, xq, m0, acc[0], acc[1]); break;
        case kQ5_0: small_block<MR, false, true>(in, b, xq, m0, acc[0], acc[1]); break;
        default: small_block<MR, true, true>(in, b, xq, m0, acc[0], acc[1]); break;
      }
      continue;
    }
    if (type == kQ6_K) {
      for (int hf = 0; hf < 2; ++hf) q6k_block_half<MR>(group + b * bytes, b, hf, xq, m0, acc[hf]);
      continue;
    }
    constexpr int kHalves = MR == 1 ? 2 : 1;  // halves a q4k_block_halves call takes
    for (int hf = 0; hf < 2; hf += kHalves) {
      if (type == kQ4_K) {
        q4k_block_halves<MR, false, kHalves>(group + b * bytes, b, hf, xq, m0, acc[hf]);
      } else {
        q4k_block_halves<MR, true, kHalves>(group + b * bytes, b, hf, xq, m0, acc[hf]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(y + (m0 + m) * ldy, acc[0][m]);
    _mm256_storeu_ps(y + (m0 + m) * ldy + 8, acc[1][m]);
  }
}
#endif

// Whether this build and CPU have a packed kernel for `type` (AVX512-VNNI or AVX2).
bool packs_type(int64_t type) {
#if defined(__AVX2__)
  return packed_group_bytes(type) > 0;
#else
  (void)type;
  return false;
#endif
}

// Rows of x that one pass over a packed group of `type` serves.
inline int packed_row_tile(int64_t type) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
  if (g_allow_vnni) return kPackedRowTile;
#endif
  return type == kQ6_K ? kQ6kRowTileAvx2 : kPackedRowTile;
}

// Rows [m0, m0 + MR) of x against one packed group: the VNNI kernels where allowed, else AVX2's.
template <int MR>
void packed_tile_any(int64_t type, const uint8_t* group, int64_t K, const QuantizedX& xq, int64_t m0, float* y,
                     int64_t ldy) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
  if constexpr (MR <= kPackedRowTile) {  // the VNNI tiles (packed_row_tile)
    if (g_allow_vnni) return packed_tile<MR>(type, group, K, xq, m0, y, ldy);
  }
#endif
#if defined(__AVX2__)
  packed_tile_avx2<MR>(type, group, K, xq, m0, y, ldy);
#endif
}

// All M rows of x against one packed group (type without the kPacked flag; the caller has
// checked packs_type, outside its threads). A row's result does not depend on the tile it is
// in: each row sums its products in the same order.
void packed_rows(int64_t type, const uint8_t* group, int64_t K, const QuantizedX& xq, int64_t M, float* y, int64_t ldy) {
  const int tile = packed_row_tile(type);
  for (int64_t m0 = 0; m0 < M; m0 += tile) {
    switch (std::min<int64_t>(tile, M - m0)) {
      case 1: packed_tile_any<1>(type, group, K, xq, m0, y, ldy); break;
      case 2: packed_tile_any<2>(type, group, K, xq, m0, y, ldy); break;
      case 3: packed_tile_any<3>(type, group, K, xq, m0, y, ldy); break;
      case 4: packed_tile_any<4>(type, group, K, xq, m0, y, ldy); break;
      case 5: packed_tile_any<5>(type, group, K, xq, m0, y, ldy); break;
      case 6: packed_tile_any<6>(type, group, K, xq, m0, y, ldy); break;
      case 7: packed_tile_any<7>(type, group, K, xq, m0, y, ldy); break;
      default: packed_tile_any<kQ6kRowTileAvx2>(type, group, K, xq, m0, y, ldy); break;
    }
  }
}

struct Parts {
  std::vector<const uint8_t*> data;
  std::vector<int64_t> types, row_bytes, first;  // row_bytes: a row's (a packed group's) stride
  int64_t N = 0;
  int64_t rows(size_t p) const { return (p + 1 < first.size() ? first[p + 1] : N) - first[p]; }
};

Parts check_parts(const at::TensorList weights, at::IntArrayRef types, int64_t K) {
  TORCH_CHECK(!weights.empty() && weights.size() == types.size(), "gguf_linear: one type per weight part");
  Parts parts;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const bool packed = is_packed(types[i]);
    const int64_t type = types[i] % kPacked;
    const TypeInfo info = type_info(type);
    TORCH_CHECK(!packed || packed_group_bytes(type) > 0, "gguf_linear: type ", type, " has no packed layout");
    const int64_t width = K / info.unit * (packed ? packed_group_bytes(type) : info.bytes);
    TORCH_CHECK(K % info.unit == 0, "gguf_linear: K = ", K, " is not a multiple of the block size ", info.unit);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.stride(1) == 1 && w.size(1) == width,
                "gguf_linear: part ", i, " must be uint8 [", packed ? "groups" : "rows", ", ", width,
                "] with contiguous rows");
    parts.data.push_back(w.data_ptr<uint8_t>());
    parts.types.push_back(types[i]);
    parts.row_bytes.push_back(w.stride(0));
    parts.first.push_back(parts.N);
    parts.N += w.size(0) * (packed ? kGroup : 1);
  }
  return parts;
}

// Whether a part reads x quantized per 256 (the K-quants' super-block products) or per 32.
bool reads_x256(int64_t type) { return is_k_type(type % kPacked); }

// out[0, n) = sums[0, n) (+ bias[0, n)) in out's dtype, rounded to bf16 as at::BFloat16 rounds
// (the same vector conversion a tensor's .to() takes).
template <typename T>
void convert_out(const float* sums, const float* bias, T* out, int64_t n) {
  using FVec = at::vec::Vectorized<float>;
  constexpr int64_t kStep = 2 * FVec::size();
  int64_t j = 0;
  for (; j + kStep <= n; j += kStep) {
    FVec a = FVec::loadu(sums + j), b = FVec::loadu(sums + j + FVec::size());
    if (bias) a = a + FVec::loadu(bias + j), b = b + FVec::loadu(bias + j + FVec::size());
    if constexpr (std::is_same_v<T, float>) {
      a.store(out + j), b.store(out + j + FVec::size());
    } else {
      at::vec::convert_from_float<T>(a, b).store(out + j, kStep);
    }
  }
  for (; j < n; ++j) out[j] = static_cast<T>(bias ? sums[j] + bias[j] : sums[j]);
}

// y[m, n0 .. n0 + n) = sums[m * lds + 0 .. n) (+ bias[n0 ..]) for rows [0, M) of y [M, N].
template <typename T>
void write_span(const float* sums, int64_t lds, int64_t M, int64_t n0, int64_t n, const float* bias, T* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m) convert_out(sums + m * lds, bias ? bias + n0 : nullptr, y + m * N + n0, n);
}

// x quantized as the parts read it: per 256 for the K-quants, per 32 for the others.
void quantize_x(const at::Tensor& x, const std::vector<int64_t>& types, QuantizedX& xq) {
  const int64_t M = x.size(0), K = x.size(1);
  xq.Kp = (K + kMaxUnit - 1) / kMaxUnit * kMaxUnit;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (std::any_of(types.begin(), types.end(), reads_x256)) {
    bf16 ? quantize_x256(x.data_ptr<at::BFloat16>(), M, K, xq) : quantize_x256(x.data_ptr<float>(), M, K, xq);
  }
  if (!std::all_of(types.begin(), types.end(), reads_x256)) {
    bf16 ? quantize_x32(x.data_ptr<at::BFloat16>(), M, K, xq) : quantize_x32(x.data_ptr<float>(), M, K, xq);
  }
}

// A product's tasks: task i is 16 outputs (fewer at a part's end) of one part. Worked out per
// task rather than listed: building the list was ~6 us of a 16384-row product's ~350 us at
// one row of x.
struct Task {
  size_t p;
  int64_t r0, rows;
};
class Tasks {
 public:
  explicit Tasks(const Parts& parts) : parts_(parts), first_(parts.types.size() + 1, 0) {
    for (size_t p = 0; p < parts.types.size(); ++p) {
      const int64_t type = parts.types[p];
      TORCH_CHECK(!is_packed(type) || packs_type(type % kPacked), "gguf_linear: no packed kernel for type ",
                  type % kPacked, " on this CPU");
      first_[p + 1] = first_[p] + (parts.rows(p) + kGroup - 1) / kGroup;
    }
  }
  int64_t count() const { return first_.back(); }
  Task at(int64_t i) const {
    size_t p = 0;
    while (first_[p + 1] <= i) ++p;
    const int64_t r0 = (i - first_[p]) * kGroup;
    return Task{p, r0, std::min(kGroup, parts_.rows(p) - r0)};
  }

 private:
  const Parts& parts_;
  std::vector<int64_t> first_;  // part p's first task
};

// Each thread streams its own share of the tasks from front to back, a stage at a time, and
// a thread whose share is done takes the back half of what is left of the share with the
// most left. One stream a thread: each new run a thread starts, its memory stream starts cold
// (at one row of x the kernels leave the reading ahead to the hardware prefetcher), and with
// runs of a fixed fraction of a product the small products streamed well below the big ones
// (docs/development.md, "one stream a thread"). The taking keeps what runs of a shared
// counter gave: on a CPU shared with the server's other processes (or a VM's neighbours) a
// thread that loses its core for a while holds up only the stage it is on, and the threads
// end within about a task of each other. Which thread computes an output does not change its
// value. Shares and the halves taken start on a stage (a stage starts on a cache line of y
// wherever the parts' sizes allow) until less than two stages are left.
class ShareClaims {
 public:
  ShareClaims(int64_t count, int64_t threads) : threads_(std::max<int64_t>(threads, 1)), shares_(threads_) {
    TORCH_CHECK(count < (int64_t{1} << 31), "gguf_linear: too many tasks");
    const int64_t stages = (count + kStageTasks - 1) / kStageTasks;
    for (int64_t t = 0; t < threads_; ++t) {
      const int64_t b = std::min(count, stages * t / threads_ * kStageTasks);
      const int64_t e = std::min(count, stages * (t + 1) / threads_ * kStageTasks);
      shares_[t].range.store(pack(b, e), std::memory_order_relaxed);
    }
  }
  // The first task of thread `slot`'s next run and its length in `take`; false once no task
  // is left to anyone.
  bool claim(int64_t slot, int64_t& begin, int64_t& take) {
    while (true) {
      std::atomic<uint64_t>& own = shares_[slot].range;
      uint64_t r = own.load(std::memory_order_relaxed);
      while (lo(r) < hi(r)) {
        const int64_t left = hi(r) - lo(r);
        take = left >= 2 * kStageTasks ? kStageTasks : std::max<int64_t>(1, left / 2);
        if (own.compare_exchange_weak(r, pack(lo(r) + take, hi(r)))) {
          begin = lo(r);
          return true;
        }
      }
      if (!take_half(slot)) return false;
    }
  }

 private:
  static uint64_t pack(int64_t b, int64_t e) { return uint64_t(b) | uint64_t(e) << 32; }
  static int64_t lo(uint64_t r) { return int64_t(r & 0xFFFFFFFFu); }
  static int64_t hi(uint64_t r) { return int64_t(r >> 32); }

  // Moves the back half of the largest share left into `slot`'s (empty) share.
  bool take_half(int64_t slot) {
    while (true) {
      int64_t victim = -1, most = 0;
      for (int64_t t = 0; t < threads_; ++t) {
        const uint64_t r = shares_[t].range.load(std::memory_order_relaxed);
        if (hi(r) - lo(r) > most) victim = t, most = hi(r) - lo(r);
      }
      if (victim < 0) return false;
      std::atomic<uint64_t>& from = shares_[victim].range;
      uint64_t r = from.load(std::memory_order_relaxed);
      const int64_t left = hi(r) - lo(r);
      if (left <= 0) continue;
      const int64_t keep = left >= 2 * kStageTasks ? (left / 2 + kStageTasks - 1) / kStageTasks * kStageTasks : left / 2;
      if (from.compare_exchange_strong(r, pack(lo(r), lo(r) + keep))) {
        shares_[slot].range.store(pack(lo(r) + keep, hi(r)), std::memory_order_relaxed);
        return true;
      }
    }
  }

  struct alignas(64) Share {  // a line each: a thread's claims do not contend with the others'
    std::atomic<uint64_t> range{0};  // [begin, end) of the tasks left: begin in the low 32 bits
  };
  const int64_t threads_;
  std::vector<Share> shares_;
};

// Tasks [s0, s1) (consecutive outputs) of x's rows into stage [M, kStageTasks * 16]; returns
// the outputs written.
int64_t stage_tasks(const Parts& parts, const Tasks& tasks, int64_t s0, int64_t s1, const QuantizedX& xq, int64_t M,
                    int64_t K, float* stage) {
  constexpr int64_t kStageWidth = kStageTasks * kGroup;
  int64_t width = 0;
  for (int64_t i = s0; i < s1; ++i) {
    const Task t = tasks.at(i);
    const int64_t type = parts.types[t.p];
    float* sums = stage + width;
    if (is_packed(type)) {
      packed_rows(type % kPacked, parts.data[t.p] + t.r0 / kGroup * parts.row_bytes[t.p], K, xq, M, sums, kStageWidth);
    } else {
      for (int64_t r = 0; r < t.rows; ++r) {
        const uint8_t* row = parts.data[t.p] + (t.r0 + r) * parts.row_bytes[t.p];
        for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
          dot_rows(type, row, K, xq, m0, std::min(kRowTile, M - m0), sums + r, kStageWidth);
        }
      }
    }
    width += t.rows;
  }
  return width;
}

// y [M, N] (fp32 or bf16) = x . W^T (+ bias) through integer dot products, 16 outputs a task.
// A stage of consecutive tasks lands in its thread's fp32 scratch [M, 64] and is written out
// from there, the bias added and bf16 rounded on the way: a pass of its own over y for each
// would cost as much as a small product's arithmetic, as one more op a linear. A stage writes
// whole cache lines of each row of y; written a task at a time (half a line of bf16 a row),
// the products of a decode step at several rows took ~5% longer.
void dot_linear(const at::Tensor& x, const Parts& parts, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedX xq;
  quantize_x(x, parts.types, xq);
  const Tasks tasks(parts);
  const int64_t count = tasks.count();
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  ShareClaims claims(count, threads);
  constexpr int64_t kStageWidth = kStageTasks * kGroup;
  at::parallel_for(0, threads, 1, [&](int64_t slot, int64_t) {
    std::vector<float> stage(M * kStageWidth);  // [M, 64]: a stage's outputs before they are written
    int64_t begin = 0, take = 0;
    while (claims.claim(slot, begin, take)) {
      const int64_t end = std::min(count, begin + take);
      for (int64_t s0 = begin; s0 < end; s0 += kStageTasks) {
        const int64_t width = stage_tasks(parts, tasks, s0, std::min(end, s0 + kStageTasks), xq, M, K, stage.data());
        const Task first = tasks.at(s0);
        const int64_t n0 = parts.first[first.p] + first.r0;
        if (y.scalar_type() == at::kBFloat16) {
          write_span(stage.data(), kStageWidth, M, n0, width, bias, y.data_ptr<at::BFloat16>(), parts.N);
        } else {
          write_span(stage.data(), kStageWidth, M, n0, width, bias, y.data_ptr<float>(), parts.N);
        }
      }
    }
  });
}

// Rows [n0, n0 + rows) of the parts, dequantized into out [rows, K] (of `dtype`).
void dequantize_rows(const Parts& parts, int64_t K, int64_t n0, int64_t rows, const at::Tensor& out,
                     const int64_t* ids = nullptr) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> buf;  // a packed row back in the file's blocks
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = ids ? ids[r] : n0 + r;
      const size_t p = std::upper_bound(parts.first.begin(), parts.first.end(), n) - parts.first.begin() - 1;
      const int64_t type = parts.types[p] % kPacked, i = n - parts.first[p];
      const uint8_t* row = parts.data[p] + i * parts.row_bytes[p];
      if (is_packed(parts.types[p])) {
        buf.resize(K / type_info(type).unit * type_info(type).bytes);
        unpack_row(type, parts.data[p] + i / kGroup * parts.row_bytes[p], K, i % kGroup, buf.data());
        row = buf.data();
      }
      if (out.scalar_type() == at::kFloat) {
        dequantize_row(type, row, K, out.data_ptr<float>() + r * K);
      } else {
        dequantize_row(type, row, K, out.data_ptr<at::BFloat16>() + r * K);
      }
    }
  });
}

// The product of checked parts: into `out` where the integer products take x's rows and out
// is [M, N] contiguous in x's dtype, else into a new tensor.
at::Tensor parts_linear(const at::Tensor& x, const Parts& parts, const std::optional<at::Tensor>& bias,
                        int64_t dot_rows, bool mm_bf16, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gguf_linear: x must be fp32 or bf16 [M, K]");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == parts.N, "gguf_linear: bias must be [N]");
  if (M <= dot_rows) {
    const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
    const bool fits = out.defined() && out.dim() == 2 && out.size(0) == M && out.size(1) == parts.N &&
                      out.is_contiguous() && out.scalar_type() == xc.scalar_type();
    at::Tensor y = fits ? out : at::empty({M, parts.N}, xc.options());  // [M, N] in x's dtype
    if (M > 0) dot_linear(xc, parts, has_bias ? b.data_ptr<float>() : nullptr, y);
    return y;
  }
  const auto mm_dtype = mm_bf16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor xm = xc.to(mm_dtype);
  at::Tensor y = at::empty({M, parts.N}, xc.options().dtype(mm_dtype));  // [M, N]
  const int64_t slab = std::max<int64_t>(16, kSlabBytes / (K * (mm_bf16 ? 2 : 4)));
  at::Tensor w = at::empty({std::min(slab, parts.N), K}, xc.options().dtype(mm_dtype));  // [slab, K]
  for (int64_t n0 = 0; n0 < parts.N; n0 += slab) {
    const int64_t rows = std::min(slab, parts.N - n0);
    at::Tensor ws = w.narrow(0, 0, rows);
    dequantize_rows(parts, K, n0, rows, ws);
    at::Tensor ys = y.narrow(1, n0, rows);  // a strided column slab, written in place
    at::mm_out(ys, xm, ws.t());
  }
  if (has_bias) y.add_(*bias);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// x [M, K] (fp32 or bf16) -> [M, N] in x's dtype. Up to `dot_rows` rows of x take the
// integer dot products; more go through at::mm on slabs dequantized to `mm_bf16` ? bf16 : fp32.
at::Tensor gguf_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                       const std::optional<at::Tensor>& bias, int64_t dot_rows, bool mm_bf16) {
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x must be fp32 or bf16 [M, K]");
  return parts_linear(x, check_parts(weights, types, x.size(1)), bias, dot_rows, mm_bf16, at::Tensor());
}

// weight uint8 [N, K / unit * bytes] of `type` -> [N, K] float32.
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t K) {
  const at::Tensor w = weight.contiguous();
  const Parts parts = check_parts({w}, {type}, K);
  at::Tensor out = at::empty({parts.N, K}, w.options().dtype(at::kFloat));  // [N, K]
  dequantize_rows(parts, K, 0, parts.N, out);
  return out;
}

// Rows `ids` of a weight (packed or in the file's blocks) to float32 [T, K]: an embedding's
// lookup. A tied embedding reads the head's packed copy, so that the file's pages of the table
// are not mapped again token by token beside it.
at::Tensor gguf_rows(const at::Tensor& weight, int64_t type, int64_t K, const at::Tensor& ids) {
  const at::Tensor w = weight.contiguous();
  const Parts parts = check_parts({w}, {type}, K);
  const at::Tensor idx = ids.to(at::kLong).contiguous().view(-1);
  const int64_t T = idx.numel();
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < parts.N, "gguf_rows: row ", id[t], " is outside [0, ", parts.N, ")");
  }
  at::Tensor out = at::empty({T, K}, w.options().dtype(at::kFloat));  // [T, K]
  dequantize_rows(parts, K, 0, T, out, id);
  return out;
}

// Decode streams every weight once a step: on 2 MiB pages the hardware prefetchers are not
// stopped at each 4 KiB boundary and the TLB covers the whole model. The packed copies are
// therefore placed back to back in arenas aligned to 2 MiB and asked for huge pages before the
// first write (where THP is on "madvise"; a no-op where it is off). Each tensor on its own
// allocation would start just past a 2 MiB boundary (the allocator's header), so only its
// aligned interior could be huge and a product of a few MiB (attention's) got none. In a VM
// that hands freed memory back to its host, the first write of each fresh huge page waits for
// the host to back it, which lengthens start-up; docs/development.md weighs that against the
// decode it buys.
constexpr int64_t kHugePage = 2 << 20;
constexpr int64_t kArenaBytes = 64 << 20;  // a fresh arena's size; larger copies get their own

struct Arena {
  uint8_t* base;
  int64_t size, used = 0;
  Arena(uint8_t* b, int64_t n) : base(b), size(n) {}
  ~Arena() { std::free(base); }
};

std::mutex arena_mutex;
std::weak_ptr<Arena> open_arena;  // the arena new copies go to while any tensor holds it

// uint8 [rows, width], uninitialised, in an arena that the tensor keeps alive.
at::Tensor huge_page_tensor(int64_t rows, int64_t width) {
  const int64_t bytes = rows * width;
  std::shared_ptr<Arena> arena;
  int64_t offset = 0;
  {
    std::lock_guard<std::mutex> lock(arena_mutex);
    arena = open_arena.lock();
    if (!arena || arena->used + bytes > arena->size) {
      const int64_t size = std::max(kArenaBytes, (bytes + kHugePage - 1) / kHugePage * kHugePage);
      auto* base = static_cast<uint8_t*>(std::aligned_alloc(kHugePage, size));
      TORCH_CHECK(base, "gguf_repack: out of memory for ", size, " bytes");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
      madvise(base, size, MADV_HUGEPAGE);
#endif
      arena = std::make_shared<Arena>(base, size);
      if (bytes < kArenaBytes) open_arena = arena;
    }
    offset = arena->used;
    arena->used += (bytes + 63) / 64 * 64;  // the next copy starts on a cache line
  }
  return at::from_blob(arena->base + offset, {rows, width}, [arena](void*) {}, at::TensorOptions().dtype(at::kByte));
}

// weight uint8 [N, K / unit * bytes] of `type` (N a multiple of 16) -> its packed groups
// uint8 [N / 16, K / unit * group bytes], for gguf_linear with type + 256.
at::Tensor gguf_repack(const at::Tensor& weight, int64_t type, int64_t K) {
  const at::Tensor w = weight.contiguous();
  const Parts parts = check_parts({w}, {type}, K);
  TORCH_CHECK(packed_group_bytes(type) > 0, "gguf_repack: type ", type, " has no packed layout");
  TORCH_CHECK(parts.N % kGroup == 0, "gguf_repack: rows must be a multiple of ", kGroup);
  const int64_t width = K / type_info(type).unit * packed_group_bytes(type);
  at::Tensor out = huge_page_tensor(parts.N / kGroup, width);  // [N / 16, width]
  // Threads claim groups as they go rather than an equal share each: a model loads while the
  // HTTP process starts up beside it, and a thread that loses its core for a while then
  // delays only the group it holds.
  const int64_t groups = parts.N / kGroup;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), groups), 1, [&](int64_t, int64_t) {
    for (int64_t g = next.fetch_add(1); g < groups; g = next.fetch_add(1)) {
      repack_group(type, parts.data[0] + g * kGroup * parts.row_bytes[0], parts.row_bytes[0], K,
                   out.data_ptr<uint8_t>() + g * width);
    }
  });
  return out;
}

// Weights registered for the C++ decoder stack (csrc/cpu_decoder.cpp), which names a product
// by one integer: a GGUFWeight's parts and type ids, and whether a bf16 x may take a bf16
// matmul above dot_rows. A key stays valid until released (the GGUFWeight's finalizer).
struct Registered {
  std::vector<at::Tensor> parts;  // holds the tensors `checked` points into
  Parts checked;
  int64_t K;
  int64_t dot_rows;
  bool mm_bf16;
};
std::mutex g_registered_mutex;
std::vector<std::shared_ptr<const Registered>> g_registered;

int64_t register_gguf_weight(at::TensorList parts, at::IntArrayRef types, int64_t dot_rows, bool mm_bf16) {
  TORCH_CHECK(!parts.empty() && parts[0].dim() == 2, "register_gguf_weight: uint8 [rows, bytes] parts");
  const int64_t type = types[0] % kPacked;
  const int64_t unit_bytes = is_packed(types[0]) ? packed_group_bytes(type) : type_info(type).bytes;
  TORCH_CHECK(unit_bytes > 0, "register_gguf_weight: type ", type, " has no packed layout");
  auto r = std::make_shared<Registered>();
  r->parts.assign(parts.begin(), parts.end());
  r->K = parts[0].size(1) / unit_bytes * type_info(type).unit;
  r->checked = check_parts(r->parts, types, r->K);
  r->dot_rows = dot_rows;
  r->mm_bf16 = mm_bf16;
  std::lock_guard<std::mutex> lock(g_registered_mutex);
  g_registered.push_back(std::move(r));
  return static_cast<int64_t>(g_registered.size()) - 1;
}

void release_gguf_weight(int64_t key) {
  std::lock_guard<std::mutex> lock(g_registered_mutex);
  if (key >= 0 && key < static_cast<int64_t>(g_registered.size())) g_registered[key].reset();
}

// GGUFWeight.forward of a registered weight (see srt_lite_ops::gguf_linear_registered).
at::Tensor gguf_linear_registered(const at::Tensor& x, int64_t key, const std::optional<at::Tensor>& bias) {
  return srt_lite_ops::gguf_linear_registered(x, key, bias, at::Tensor());
}

}  // namespace

// GGUFWeight.forward of a registered weight: x in fp32 or bf16 as is, other dtypes in fp32.
// Into `out` as parts_linear writes it.
at::Tensor srt_lite_ops::gguf_linear_registered(const at::Tensor& x, int64_t key, const std::optional<at::Tensor>& bias,
                                                const at::Tensor& out) {
  std::shared_ptr<const Registered> r;
  {
    std::lock_guard<std::mutex> lock(g_registered_mutex);
    TORCH_CHECK(key >= 0 && key < static_cast<int64_t>(g_registered.size()) && g_registered[key],
                "gguf_linear_registered: no weight ", key);
    r = g_registered[key];
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) == r->K, "gguf_linear_registered: x must be [M, ", r->K, "]");
  const bool direct = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
  const at::Tensor xin = direct ? x : x.to(at::kFloat);
  const bool mm_bf16 = xin.scalar_type() == at::kBFloat16 && r->mm_bf16;
  at::Tensor y = parts_linear(xin, r->checked, bias, r->dot_rows, mm_bf16, direct ? out : at::Tensor());
  return direct ? y : y.to(x.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor[] weights, int[] types, Tensor? bias, int dot_rows, bool mm_bf16) -> Tensor");
  m.def("gguf_dequantize(Tensor weight, int type, int K) -> Tensor");
  m.def("gguf_rows(Tensor weight, int type, int K, Tensor ids) -> Tensor");
  m.def("gguf_repack(Tensor weight, int type, int K) -> Tensor");
  m.def("register_gguf_weight(Tensor[] parts, int[] types, int dot_rows, bool mm_bf16) -> int");
  m.def("release_gguf_weight(int key) -> ()");
  m.def("gguf_linear_registered(Tensor x, int key, Tensor? bias) -> Tensor");
  m.def("gguf_allow_vnni(bool allow) -> ()");
  m.def("gguf_packs(int type) -> bool");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_rows", &gguf_rows);
  m.impl("gguf_repack", &gguf_repack);
  m.impl("gguf_linear_registered", &gguf_linear_registered);
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CompositeExplicitAutograd, m) {
  m.impl("gguf_allow_vnni", &gguf_allow_vnni);
  m.impl("gguf_packs", &packs_type);
  m.impl("register_gguf_weight", &register_gguf_weight);
  m.impl("release_gguf_weight", &release_gguf_weight);
}
