// Causal attention for prompts on the CPU: rows of many new tokens (a prompt, a chunk of
// one, or a prompt after a cached prefix), each attending its own keys, one call per layer.
//
// torch's CPU flash kernel (SDPA) runs a causal prompt of a few hundred tokens at a small
// fraction of the cores' dot-product speed, and a batch of prompts padded to the longest
// under a mask computes every padded pair besides. Here:
// - each (row, KV head) gathers its keys and values from the pool once, into panels laid
//   out for the dot products (16 keys a vector for Q K^T, 16 head dims a vector for P V), as
//   the linear layers' panels are (cpu_linear.cpp);
// - a row's queries go in tiles of a few query rows (a token's G heads, then the next
//   token's); a tile computes its scores over the keys its last query may see, a plain
//   softmax (the scores of one tile fit in cache, so no online rescaling is needed) and its
//   product with V. Keys past a query's position weigh zero;
// - the work is split into (row, KV head, block of tiles) tasks, handed out to the threads
//   longest first as they come free: causal blocks differ in cost, and a layer has only a
//   few KV heads to share between the threads.
// bf16 with AVX512-BF16 computes both products in bf16 dot products (vdpbf16ps, fp32 sums;
// the probabilities are rounded to bf16 for P V, as torch's flash kernel does); everything
// else widens to fp32 and uses at::vec multiply-adds, which every build has.
// Built with the other sources into one extension by srt_lite/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_attention_common.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
#define SRT_LITE_PROMPT_BF16_DOT 1
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// Query rows of one tile. bf16 dots: 6 rows x 4 key vectors are 24 accumulators, with the
// 4 key vectors and a broadcast in AVX-512's 32 registers. fp32 multiply-adds: the same on
// AVX-512, 4 rows x 2 vectors within AVX2's 16.
constexpr int64_t kBf16Rows = 6;
constexpr int64_t kF32Rows = W >= 16 ? 6 : 4;
constexpr int64_t kF32KeyVecs = W >= 16 ? 4 : 2;
// Tiles of one task: enough work to outweigh taking a task, few enough that the last
// tasks of a layer still share out evenly.
constexpr int64_t kTilesPerTask = 8;
// Largest panel buffer kept from one call to the next (per calling thread).
constexpr int64_t kKeepPackBytes = int64_t{8} << 20;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

inline float bf16_to_float(uint16_t h) {
  const uint32_t word = static_cast<uint32_t>(h) << 16;  // bf16 is a float's high half
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return bf16_to_float(x.x); }

// One (row, KV head): its queries, keys, and where its packed keys and values start.
struct Part {
  int64_t b, h, q0, nq, nk;
  const int64_t* slots;  // [nk] pool slots of the row's keys, in position order
  int64_t pack;          // offset of its panels in the pack buffer, in elements
};

// A task: tiles [t0, t1) of one part.
struct Task {
  int64_t part, t0, t1, cost;
};

struct Shape {
  int64_t H, Hkv, G, D;
  float scale;
};

// ---------------------------------------------------------------------------------------
// Packing. bf16 dots: K as [ceil(nk / 16), D / 2, 16, 2] (one d pair of 16 keys a vector)
// and V as [D / 16, ceil(nk / 2), 16, 2] (one key pair of 16 dims a vector), zero padded.
// fp32: K as [ceil(nk / W), D, W] and V as [nk, D], widened.

inline int64_t bf16_pack_elems(int64_t nk, int64_t D) { return round_up(nk, 16) * D + D * round_up(nk, 2); }
inline int64_t f32_pack_elems(int64_t nk, int64_t D) { return round_up(nk, W) * D + nk * D; }

// V's pairs: vp [D / 16, npairs, 16, 2], element (d, key j) at ((d / 16, j / 2, d % 16, j % 2)).
// A pure copy: with AVX-512 two keys' 16 dims become one vector of (key 2i, key 2i + 1) pairs
// (each widened to 32 bits, the second shifted into the high half), instead of 32 scalar
// stores; a decode row packs its whole context every layer, so this copy is on its path.
#if defined(SRT_LITE_PROMPT_BF16_DOT)
__attribute__((target("avx512f,avx512bw")))
#endif
void pack_v_pairs(const Part& p, const uint16_t* vb, int64_t row_stride, int64_t D, int64_t npairs, uint16_t* vp) {
  const int64_t nk = p.nk;
#if defined(SRT_LITE_PROMPT_BF16_DOT)
  for (int64_t j = 0; j + 1 < nk; j += 2) {
    const uint16_t* a = vb + p.slots[j] * row_stride + p.h * D;
    const uint16_t* b = vb + p.slots[j + 1] * row_stride + p.h * D;
    for (int64_t c = 0; c < D / 16; ++c) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c * 16)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c * 16)));
      _mm512_storeu_si512(vp + (c * npairs + j / 2) * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  for (int64_t j = nk & ~int64_t{1}; j < nk; ++j) {  // an odd last key; its pair's other half is zero
#else
  for (int64_t j = 0; j < nk; ++j) {
#endif
    const uint16_t* src = vb + p.slots[j] * row_stride + p.h * D;
    for (int64_t d = 0; d < D; ++d) {
      vp[(((d / 16) * npairs + j / 2) * 16 + d % 16) * 2 + j % 2] = src[d];
    }
  }
}

// K's d pairs: kp [ceil(nk / 16), D / 2, 16], pair q of key j at ((j / 16, q, j % 16)), the
// padding keys zero. A pure copy like V's: with AVX-512 one gather takes pair q of 16 keys
// from their pool rows, instead of 16 scalar stores 64 bytes apart (gather indices are
// 32-bit, so a pool too large for them takes the scalar loop).
#if defined(SRT_LITE_PROMPT_BF16_DOT)
__attribute__((target("avx512f")))
#endif
void pack_k_pairs(const Part& p, const uint16_t* kb, int64_t row_stride, int64_t D, int64_t pool_rows, uint32_t* kp) {
  const int64_t nk = p.nk;
#if defined(SRT_LITE_PROMPT_BF16_DOT)
  if (pool_rows * row_stride / 2 < INT32_MAX) {
    const uint16_t* head = kb + p.h * D;
    for (int64_t j0 = 0; j0 < nk; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, nk - j0);
      alignas(64) int32_t idx[16] = {0};  // each key's row, in pairs from the head's first
      for (int64_t i = 0; i < n; ++i) idx[i] = static_cast<int32_t>(p.slots[j0 + i] * row_stride / 2);
      const __m512i rows = _mm512_load_si512(idx);
      const __mmask16 mask = n == 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
      uint32_t* to = kp + (j0 / 16) * (D / 2) * 16;
      for (int64_t q = 0; q < D / 2; ++q) {
        const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, head + 2 * q, 4);
        _mm512_storeu_si512(to + q * 16, v);
      }
    }
    return;
  }
#endif
  std::memset(kp, 0, round_up(nk, 16) * D * sizeof(uint16_t));
  for (int64_t j = 0; j < nk; ++j) {
    const uint16_t* src = kb + p.slots[j] * row_stride + p.h * D;
    uint32_t* to = kp + (j / 16) * (D / 2) * 16 + j % 16;
    for (int64_t q = 0; q < D / 2; ++q) {
      uint32_t pair;
      std::memcpy(&pair, src + 2 * q, sizeof(pair));
      to[q * 16] = pair;
    }
  }
}

void pack_bf16(const Part& p, const uint16_t* kb, const uint16_t* vb, int64_t row_stride, int64_t D, int64_t pool_rows,
               uint16_t* dst) {
  const int64_t nk = p.nk, nvk = round_up(nk, 16) / 16, npairs = round_up(nk, 2) / 2;
  pack_k_pairs(p, kb, row_stride, D, pool_rows, reinterpret_cast<uint32_t*>(dst));  // [nvk, D / 2, 16] of d pairs
  uint16_t* vp = dst + nvk * 16 * D;  // [D / 16, npairs, 16, 2]
  if (nk % 2) {
    for (int64_t c = 0; c < D / 16; ++c) {
      for (int64_t i = 0; i < 16; ++i) vp[((c * npairs + npairs - 1) * 16 + i) * 2 + 1] = 0;
    }
  }
  pack_v_pairs(p, vb, row_stride, D, npairs, vp);
}

template <typename T>
void pack_f32(const Part& p, const T* kb, const T* vb, int64_t row_stride, int64_t D, float* dst) {
  const int64_t nk = p.nk, nvk = round_up(nk, W) / W;
  std::memset(dst, 0, nvk * W * D * sizeof(float));
  for (int64_t j = 0; j < nk; ++j) {
    const T* src = kb + p.slots[j] * row_stride + p.h * D;
    float* to = dst + (j / W) * D * W + j % W;
    for (int64_t d = 0; d < D; ++d) to[d * W] = to_f(src[d]);
  }
  float* vp = dst + nvk * W * D;  // [nk, D]
  for (int64_t j = 0; j < nk; ++j) {
    const T* src = vb + p.slots[j] * row_stride + p.h * D;
    for (int64_t d = 0; d < D; ++d) vp[j * D + d] = to_f(src[d]);
  }
}

// ---------------------------------------------------------------------------------------
// Softmax of one tile's scores s [rows, lds] over the first n[m] keys of each row, in place:
// s[m, j] = exp(s[m, j] - max) for j < n[m], 0 up to `width` (a multiple of W); returns the
// sums in l[m].
void softmax_rows(float* s, int64_t lds, int64_t rows, const int64_t* n, int64_t width, float* l) {
  for (int64_t m = 0; m < rows; ++m) l[m] = srt_lite_attn::softmax_row(s + m * lds, n[m], width).sum;
}

// The tile's query rows: row r of a part is head h * G + r % G of its token r / G.
struct TileRows {
  int64_t tok[kBf16Rows > kF32Rows ? kBf16Rows : kF32Rows];
  int64_t head[kBf16Rows > kF32Rows ? kBf16Rows : kF32Rows];
  int64_t n[kBf16Rows > kF32Rows ? kBf16Rows : kF32Rows];  // keys each row sees
  int64_t rows = 0;                                       // real rows (the rest pad the tile)
  int64_t nmax = 0;
};

TileRows tile_rows(const Part& p, const Shape& sh, int64_t tile, int64_t MR) {
  TileRows t;
  const int64_t R = p.nq * sh.G;
  for (int64_t m = 0; m < MR; ++m) {
    const int64_t r = std::min(tile * MR + m, R - 1);  // a padding row repeats the last real one
    const int64_t i = r / sh.G;
    t.tok[m] = p.q0 + i;
    t.head[m] = p.h * sh.G + r % sh.G;
    t.n[m] = p.nk - p.nq + i + 1;
    if (tile * MR + m < R) t.rows = m + 1;
  }
  t.nmax = t.n[MR - 1];
  return t;
}

// ---------------------------------------------------------------------------------------
// fp32: at::vec multiply-adds.

// s[m, 16 keys of vector kv + b] for b < NB: dot(q[m], k) * scale.
template <int64_t MR, int64_t NB>
void qk_f32(const float* q, const float* kpanel, int64_t D, float scale, float* s, int64_t lds) {
  Vec acc[MR][NB];
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t b = 0; b < NB; ++b) acc[m][b] = Vec(0.f);
  }
  for (int64_t d = 0; d < D; ++d) {
    Vec kv[NB];
    for (int64_t b = 0; b < NB; ++b) kv[b] = Vec::loadu(kpanel + (b * D + d) * W);
    for (int64_t m = 0; m < MR; ++m) {
      const Vec qb(q[m * D + d]);
      for (int64_t b = 0; b < NB; ++b) acc[m][b] = at::vec::fmadd(qb, kv[b], acc[m][b]);
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t b = 0; b < NB; ++b) (acc[m][b] * Vec(scale)).store(s + m * lds + b * W);
  }
}

// acc[m][c] = sum_j<n p[m, j] * v[j, c * W ..] for NC vectors of the head dim.
template <int64_t MR, int64_t NC>
void pv_f32(const float* p, int64_t ldp, const float* v, int64_t D, int64_t n, Vec (&acc)[MR][NC]) {
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t c = 0; c < NC; ++c) acc[m][c] = Vec(0.f);
  }
  for (int64_t j = 0; j < n; ++j) {
    Vec vv[NC];
    for (int64_t c = 0; c < NC; ++c) vv[c] = Vec::loadu(v + j * D + c * W);
    for (int64_t m = 0; m < MR; ++m) {
      const Vec pb(p[m * ldp + j]);
      for (int64_t c = 0; c < NC; ++c) acc[m][c] = at::vec::fmadd(pb, vv[c], acc[m][c]);
    }
  }
}

template <typename T>
void store_row(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <typename T>
void tile_f32(const Part& p, const Shape& sh, const float* pack, int64_t tile, const T* qp, int64_t qs, T* op,
              int64_t os, float* s, int64_t lds, float* qbuf) {
  constexpr int64_t MR = kF32Rows, NB = kF32KeyVecs;
  const int64_t D = sh.D;
  const TileRows t = tile_rows(p, sh, tile, MR);
  for (int64_t m = 0; m < MR; ++m) {
    const T* src = qp + t.tok[m] * qs + t.head[m] * D;
    for (int64_t d = 0; d < D; ++d) qbuf[m * D + d] = to_f(src[d]);
  }
  const float* kpanel = pack;
  const float* vrows = pack + round_up(p.nk, W) * D;
  const int64_t nv = round_up(t.nmax, W) / W;
  int64_t kv = 0;
  for (; kv + NB <= nv; kv += NB) qk_f32<MR, NB>(qbuf, kpanel + kv * D * W, D, sh.scale, s + kv * W, lds);
  for (; kv < nv; ++kv) qk_f32<MR, 1>(qbuf, kpanel + kv * D * W, D, sh.scale, s + kv * W, lds);
  float l[MR];
  softmax_rows(s, lds, MR, t.n, nv * W, l);
  for (int64_t c0 = 0; c0 < D; c0 += NB * W) {
    float res[MR][NB * W];
    if (c0 + NB * W <= D) {
      Vec acc[MR][NB];
      pv_f32<MR, NB>(s, lds, vrows + c0, D, t.nmax, acc);
      for (int64_t m = 0; m < MR; ++m) {
        for (int64_t c = 0; c < NB; ++c) (acc[m][c] * Vec(1.f / l[m])).store(res[m] + c * W);
      }
    } else {
      for (int64_t c = 0; c0 + c * W < D; ++c) {
        Vec acc[MR][1];
        pv_f32<MR, 1>(s, lds, vrows + c0 + c * W, D, t.nmax, acc);
        for (int64_t m = 0; m < MR; ++m) (acc[m][0] * Vec(1.f / l[m])).store(res[m] + c * W);
      }
    }
    const int64_t width = std::min(NB * W, D - c0);
    for (int64_t m = 0; m < t.rows; ++m) store_row(op + t.tok[m] * os + t.head[m] * D + c0, res[m], width);
  }
}

// ---------------------------------------------------------------------------------------
// bf16: AVX512-BF16 dot products, each adding a pair of products into an fp32 lane.
#ifdef SRT_LITE_PROMPT_BF16_DOT
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// s[m, keys of vectors kv..kv + NB) = dot(q[m], k) * scale; q [MR, D] bf16, kpanel at
// vector kv (vectors D / 2 * 16 pairs apart).
template <int MR, int NB>
BF16_TARGET void qk_bf16(const uint16_t* q, const uint32_t* kpanel, int64_t D, float scale, float* s, int64_t lds) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m) {
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  }
  const int64_t kp = D / 2;
  for (int64_t p = 0; p < kp; ++p) {
    __m512i kv[NB];
    for (int b = 0; b < NB; ++b) kv[b] = _mm512_loadu_si512(kpanel + (b * kp + p) * 16);
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      std::memcpy(&pair, q + m * D + 2 * p, sizeof(pair));
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(pair));
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], (__m512bh)qb, (__m512bh)kv[b]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int m = 0; m < MR; ++m) {
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(s + m * lds + b * 16, _mm512_mul_ps(acc[m][b], sc));
  }
}

// acc[m][c] = sum over key pairs [0, np) of p[m, pair] . v's pair vector, for NC vectors of
// 16 dims (vpanel at the first; vectors npairs * 16 pairs apart).
template <int MR, int NC>
BF16_TARGET void pv_bf16(const uint16_t* p, int64_t ldp, const uint32_t* vpanel, int64_t npairs, int64_t np,
                         __m512 (&acc)[MR][NC]) {
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < np; ++j) {
    __m512i vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_si512(vpanel + (c * npairs + j) * 16);
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      std::memcpy(&pair, p + m * ldp + 2 * j, sizeof(pair));
      const __m512i pb = _mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)pb, (__m512bh)vv[c]);
    }
  }
}

// Rounds a tile's probabilities s [MR, lds] to bf16 pb [MR, ldp] over `width` keys.
BF16_TARGET void round_probs(const float* s, int64_t lds, int64_t rows, int64_t width, uint16_t* pb, int64_t ldp) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t j = 0; j < width; j += 16) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + m * lds + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + m * ldp + j), h);
    }
  }
}

template <int MR, int NC>
BF16_TARGET void pv_store_bf16(const uint16_t* pb, int64_t ldp, const uint32_t* vpanel, int64_t npairs, int64_t np,
                               const TileRows& t, const float* l, int64_t c0, uint16_t* op, int64_t os, int64_t D) {
  __m512 acc[MR][NC];
  pv_bf16<MR, NC>(pb, ldp, vpanel + c0 * npairs * 16, npairs, np, acc);
  for (int64_t m = 0; m < t.rows; ++m) {
    const __m512 inv = _mm512_set1_ps(1.f / l[m]);
    uint16_t* dst = op + t.tok[m] * os + t.head[m] * D + c0 * 16;
    for (int c = 0; c < NC; ++c) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[m][c], inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16), h);
    }
  }
}

// One tile of MR query rows (kBf16Rows, or fewer for a part that has fewer rows: a decode
// row's G heads). Each row has its own sums over the same keys in the same order, so a row's
// result does not depend on MR.
template <int MR>
void tile_bf16(const Part& p, const Shape& sh, const uint16_t* pack, int64_t tile, const uint16_t* qp, int64_t qs,
               uint16_t* op, int64_t os, float* s, int64_t lds, uint16_t* qbuf, uint16_t* pb, int64_t ldp) {
  const int64_t D = sh.D;
  const TileRows t = tile_rows(p, sh, tile, MR);
  for (int64_t m = 0; m < MR; ++m) std::memcpy(qbuf + m * D, qp + t.tok[m] * qs + t.head[m] * D, D * sizeof(uint16_t));
  const uint32_t* kpanel = reinterpret_cast<const uint32_t*>(pack);
  const int64_t npairs = round_up(p.nk, 2) / 2;
  const uint32_t* vpanel = reinterpret_cast<const uint32_t*>(pack + round_up(p.nk, 16) * D);
  const int64_t nv = round_up(t.nmax, 16) / 16;
  int64_t kv = 0;
  for (; kv + 4 <= nv; kv += 4) qk_bf16<MR, 4>(qbuf, kpanel + kv * (D / 2) * 16, D, sh.scale, s + kv * 16, lds);
  for (; kv < nv; ++kv) qk_bf16<MR, 1>(qbuf, kpanel + kv * (D / 2) * 16, D, sh.scale, s + kv * 16, lds);
  float l[MR];
  softmax_rows(s, lds, MR, t.n, nv * 16, l);
  round_probs(s, lds, MR, nv * 16, pb, ldp);
  const int64_t np = round_up(t.nmax, 2) / 2;  // pairs past a row's keys hold zeros
  const int64_t nc = D / 16;
  int64_t c0 = 0;
  for (; c0 + 4 <= nc; c0 += 4) pv_store_bf16<MR, 4>(pb, ldp, vpanel, npairs, np, t, l, c0, op, os, D);
  for (; c0 < nc; ++c0) pv_store_bf16<MR, 1>(pb, ldp, vpanel, npairs, np, t, l, c0, op, os, D);
}

// tile_bf16 with as few rows as the part has, up to kBf16Rows.
void tile_bf16_rows(int64_t rows, const Part& p, const Shape& sh, const uint16_t* pack, int64_t tile,
                    const uint16_t* qp, int64_t qs, uint16_t* op, int64_t os, float* s, int64_t lds, uint16_t* qbuf,
                    uint16_t* pb, int64_t ldp) {
  static_assert(kBf16Rows == 6, "tile_bf16_rows covers 1 .. 6 rows");
  switch (std::min<int64_t>(rows, kBf16Rows)) {
    case 1: return tile_bf16<1>(p, sh, pack, tile, qp, qs, op, os, s, lds, qbuf, pb, ldp);
    case 2: return tile_bf16<2>(p, sh, pack, tile, qp, qs, op, os, s, lds, qbuf, pb, ldp);
    case 3: return tile_bf16<3>(p, sh, pack, tile, qp, qs, op, os, s, lds, qbuf, pb, ldp);
    case 4: return tile_bf16<4>(p, sh, pack, tile, qp, qs, op, os, s, lds, qbuf, pb, ldp);
    case 5: return tile_bf16<5>(p, sh, pack, tile, qp, qs, op, os, s, lds, qbuf, pb, ldp);
    default: return tile_bf16<6>(p, sh, pack, tile, qp, qs, op, os, s, lds, qbuf, pb, ldp);
  }
}
#undef BF16_TARGET
#endif

bool bf16_dot_built() {
#ifdef SRT_LITE_PROMPT_BF16_DOT
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------

// The op's arguments (see prompt_attention), checked before anything is read: a bad slot or
// offset would read outside the pool or write outside out.
void check_args(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& slots,
                const at::Tensor& q_off, const at::Tensor& k_off, int64_t num_heads, const at::Tensor& out) {
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes() && k_buf.is_contiguous() && v_buf.is_contiguous(),
              "prompt_attention: KV buffers contiguous [N, Hkv, D]");
  const int64_t N = k_buf.size(0), Hkv = k_buf.size(1), D = k_buf.size(2);
  TORCH_CHECK(Hkv > 0 && num_heads % Hkv == 0, "prompt_attention: num_heads a multiple of the KV heads");
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && k_buf.scalar_type() == dtype &&
                  v_buf.scalar_type() == dtype && out.scalar_type() == dtype,
              "prompt_attention: bf16 or fp32 throughout");
  TORCH_CHECK(D % 16 == 0, "prompt_attention: head_dim a multiple of 16");
  TORCH_CHECK(q_off.scalar_type() == at::kLong && k_off.scalar_type() == at::kLong && q_off.dim() == 1 &&
                  q_off.is_contiguous() && k_off.is_contiguous() && k_off.sizes() == q_off.sizes() &&
                  q_off.size(0) >= 2 && q_off.device().is_cpu() && k_off.device().is_cpu(),
              "prompt_attention: row offsets contiguous int64 [B + 1] on the host");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "prompt_attention: slots contiguous int64 [S]");
  const int64_t B = q_off.size(0) - 1, S = slots.size(0);
  const int64_t* qo = q_off.data_ptr<int64_t>();
  const int64_t* ko = k_off.data_ptr<int64_t>();
  TORCH_CHECK(qo[0] == 0 && ko[0] == 0 && ko[B] == S, "prompt_attention: offsets start at 0 and span the slots");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qo[b + 1] - qo[b], nk = ko[b + 1] - ko[b];
    TORCH_CHECK(nq >= 1 && nk >= nq, "prompt_attention: row ", b, " has ", nq, " queries over ", nk, " keys");
  }
  const int64_t T = qo[B];
  TORCH_CHECK(q.dim() == 2 && out.dim() == 2 && q.size(0) >= T && out.size(0) >= T && q.size(1) == num_heads * D &&
                  out.size(1) == num_heads * D && q.stride(1) == 1 && out.stride(1) == 1,
              "prompt_attention: q and out [T, H * D] with contiguous rows");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < N, "prompt_attention: slot ", sl[i], " out of range [0, ", N, ")");
  }
}

// Every (row, KV head) part, with the place of its panels in the pack buffer.
struct Parts {
  std::vector<Part> parts;
  int64_t pack_elems = 0;  // the buffer's size, in elements
  int64_t max_k = 0;       // keys of the longest row
};

Parts plan_parts(const at::Tensor& slots, const at::Tensor& q_off, const at::Tensor& k_off, int64_t Hkv, int64_t D,
                 bool dots) {
  const int64_t B = q_off.size(0) - 1;
  const int64_t* qo = q_off.data_ptr<int64_t>();
  const int64_t* ko = k_off.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  Parts out;
  out.parts.reserve(B * Hkv);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nk = ko[b + 1] - ko[b];
    out.max_k = std::max(out.max_k, nk);
    for (int64_t h = 0; h < Hkv; ++h) {
      out.parts.push_back({b, h, qo[b], qo[b + 1] - qo[b], nk, sl + ko[b], out.pack_elems});
      out.pack_elems += dots ? bf16_pack_elems(nk, D) : f32_pack_elems(nk, D);
    }
  }
  return out;
}

// Tasks, costliest first (a tile's cost: the keys its last query sees).
std::vector<Task> plan_tasks(const std::vector<Part>& parts, int64_t G, int64_t MR) {
  std::vector<Task> tasks;
  for (int64_t i = 0; i < static_cast<int64_t>(parts.size()); ++i) {
    const Part& p = parts[i];
    const int64_t tiles = (p.nq * G + MR - 1) / MR;
    for (int64_t t0 = 0; t0 < tiles; t0 += kTilesPerTask) {
      const int64_t t1 = std::min(tiles, t0 + kTilesPerTask);
      const int64_t last_row = std::min(t1 * MR, p.nq * G) - 1;
      tasks.push_back({i, t0, t1, (t1 - t0) * (p.nk - p.nq + last_row / G + 1)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

// The panel buffer of one call (pack_bytes). Up to kKeepPackBytes it is kept for the next
// call (a fresh one of a few MB, every layer, pays its page faults every time); a larger one
// is a tensor that `big` holds for the call.
uint8_t* pack_buffer(int64_t pack_bytes, const at::Tensor& like, at::Tensor& big) {
  static thread_local std::vector<uint8_t> kept;
  if (pack_bytes <= kKeepPackBytes) {
    if (static_cast<int64_t>(kept.size()) < pack_bytes) kept.resize(pack_bytes);
    return kept.data();
  }
  big = at::empty({pack_bytes}, like.options().dtype(at::kByte));  // [bytes]
  return big.data_ptr<uint8_t>();
}

// What every task of one call reads and writes.
struct Call {
  const at::Tensor& q;
  const at::Tensor& k_buf;
  const at::Tensor& v_buf;
  const at::Tensor& out;
  Shape sh;
  bool dots;      // bf16 dot products (else fp32 multiply-adds)
  uint8_t* pack;  // the pack buffer
};

void pack_part(const Call& c, const Part& p) {
  const int64_t D = c.sh.D, row_stride = c.sh.Hkv * D;
  if (c.dots) {
    pack_bf16(p, reinterpret_cast<const uint16_t*>(c.k_buf.data_ptr()), reinterpret_cast<const uint16_t*>(c.v_buf.data_ptr()),
              row_stride, D, c.k_buf.size(0), reinterpret_cast<uint16_t*>(c.pack) + p.pack);
  } else if (c.q.scalar_type() == at::kBFloat16) {
    pack_f32(p, c.k_buf.data_ptr<c10::BFloat16>(), c.v_buf.data_ptr<c10::BFloat16>(), row_stride, D,
             reinterpret_cast<float*>(c.pack) + p.pack);
  } else {
    pack_f32(p, c.k_buf.data_ptr<float>(), c.v_buf.data_ptr<float>(), row_stride, D,
             reinterpret_cast<float*>(c.pack) + p.pack);
  }
}

// A worker's buffers: s [MR, lds] scores, then probabilities; qf / qh [MR, D] the tile's
// queries (fp32 / bf16 path); ph [MR, lds] bf16 probabilities.
struct TileScratch {
  std::vector<float> s, qf;
  std::vector<uint16_t> qh, ph;
  int64_t lds;
};

void run_tile(const Call& c, const Part& p, int64_t tile, TileScratch& t) {
  const at::Tensor& q = c.q;
  const at::Tensor& out = c.out;
  if (c.dots) {
#ifdef SRT_LITE_PROMPT_BF16_DOT
    tile_bf16_rows(p.nq * c.sh.G, p, c.sh, reinterpret_cast<const uint16_t*>(c.pack) + p.pack, tile,
                   reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), reinterpret_cast<uint16_t*>(out.data_ptr()),
                   out.stride(0), t.s.data(), t.lds, t.qh.data(), t.ph.data(), t.lds);
#endif
  } else if (q.scalar_type() == at::kBFloat16) {
    tile_f32(p, c.sh, reinterpret_cast<const float*>(c.pack) + p.pack, tile, q.data_ptr<c10::BFloat16>(), q.stride(0),
             out.data_ptr<c10::BFloat16>(), out.stride(0), t.s.data(), t.lds, t.qf.data());
  } else {
    tile_f32(p, c.sh, reinterpret_cast<const float*>(c.pack) + p.pack, tile, q.data_ptr<float>(), q.stride(0),
             out.data_ptr<float>(), out.stride(0), t.s.data(), t.lds, t.qf.data());
  }
}

// One layer's prompt attention. q [>= T, H * D] and out [>= T, H * D] with contiguous rows
// (rows T.. are left as they are); k_buf, v_buf [N, Hkv, D] the layer's pool, the step's
// K/V already stored; slots [S] every row's key slots, row after row; q_off, k_off [B + 1]
// (int64 on the host) where each row's queries and keys start. A row's i-th query is at
// position nk - nq + i of its keys and sees keys 0 .. that position. bf16_dot: compute a
// bf16 layer in AVX512-BF16 dot products (the caller asks only where the CPU has them).
void prompt_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& slots,
                      const at::Tensor& q_off, const at::Tensor& k_off, int64_t num_heads, double scale, bool bf16_dot,
                      at::Tensor out) {
  check_args(q, k_buf, v_buf, slots, q_off, k_off, num_heads, out);
  const int64_t Hkv = k_buf.size(1), D = k_buf.size(2);
  const bool dots = bf16_dot && q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!dots || bf16_dot_built(), "prompt_attention: no AVX512-BF16 in this CPU or build");
  const Shape sh{num_heads, Hkv, num_heads / Hkv, D, static_cast<float>(scale)};
  const int64_t MR = dots ? kBf16Rows : kF32Rows;
  const Parts parts = plan_parts(slots, q_off, k_off, Hkv, D, dots);
  at::Tensor big;
  const Call call{q, k_buf, v_buf, out, sh, dots, pack_buffer(parts.pack_elems * (dots ? 2 : 4), q, big)};
  const std::vector<Task> tasks = plan_tasks(parts.parts, sh.G, MR);
  // One task per part (decode and short rows): each task packs its own part first, in the
  // same pass; otherwise the parts are packed in a pass of their own before any task reads them.
  const bool pack_in_task = tasks.size() == parts.parts.size();
  if (!pack_in_task) {
    at::parallel_for(0, static_cast<int64_t>(parts.parts.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) pack_part(call, parts.parts[i]);
    });
  }
  std::atomic<int64_t> next{0};
  const int64_t lds = round_up(parts.max_k, 16) + 16;  // a tile's scores, padded to whole key vectors
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    TileScratch t{std::vector<float>(MR * lds), std::vector<float>(MR * D), std::vector<uint16_t>(MR * D),
                  std::vector<uint16_t>(dots ? MR * lds : 0), lds};
    for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(tasks.size());) {
      const Task& task = tasks[i];
      const Part& p = parts.parts[task.part];
      if (pack_in_task) pack_part(call, p);
      for (int64_t tile = task.t0; tile < task.t1; ++tile) run_tile(call, p, tile, t);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def(
      "prompt_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor q_off, Tensor k_off, int num_heads, "
      "float scale, bool bf16_dot, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) { m.impl("prompt_attention", &prompt_attention); }
