// srt_lite_prefix::attention: the shared-prefix part of a cascade step (cpu_attention.cpp),
// for bf16 KV, on AMX tiles or, without them, AVX512-BF16 vectors.
//
// Every query of the step (T tokens x G query heads per KV head) attends to the same prefix
// keys, so the work is two small matrix products per KV head, S = Q . K^T and O = P . V,
// over keys that are read once for all queries. torch's flash attention makes one task per
// KV head (too few for the threads at a model's 2-8 KV heads) and multiplies in fp32
// vectors; here the prefix is split into key chunks, one task per (KV head, chunk), whose
// partial softmax sums are merged by log-sum-exp afterwards, and both products take bf16
// pairs in hardware.
//
// Tiles take their B operand in pairs of k: K^T's pairs are two adjacent head-dim elements of
// each key (a 16 x 16 transpose of 32-bit words of 16 keys), V's are the same element of
// two adjacent keys (an interleave of two key rows). Both are built per chunk in the task's
// scratch, so the keys may lie anywhere in the pool. A tile row is also what vdpbf16ps takes
// as one operand (16 lanes of a bf16 pair), so the vector kernels read the same packing,
// with the other operand's pair broadcast. The scores are fp32; the probabilities take
// bf16 for P . V, as in flash attention's bf16 kernels, and their sum stays fp32.

#include "cpu_prefix_attention.h"

#include "cpu_amx.h"
#include "cpu_attention_common.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

namespace srt_lite_prefix {
namespace {

bool tiles_allowed = true, vectors_allowed = true;  // allow_kernels

// The kernels need AVX-512 builds of GCC 11+ (SRT_LITE_HAVE_AMX), vectors as well as tiles.
#ifdef SRT_LITE_HAVE_AMX
using srt_lite_amx::load_config;
using srt_lite_amx::release_tiles;
using srt_lite_amx::TileConfig;

constexpr int64_t kTileWords = 512;   // bf16 elements of one 16 x 64-byte tile
constexpr int64_t kKeyBlock = 32;     // keys of one P . V tile step (16 key pairs)
constexpr int64_t kQueryBlock = 32;   // queries per pass over a chunk: two tiles of 16 rows
// Keys per task: enough tasks for the threads to share evenly, few enough partial sums.
constexpr int64_t kMinChunkKeys = 64;
constexpr int64_t kMaxChunkKeys = 512;

using Vec = at::vec::Vectorized<float>;

// Every tile 16 rows x 64 bytes: tiles 0-3 accumulate, 4-5 take A (queries, or their
// probabilities), 6-7 take B (keys, or values).
__attribute__((target("amx-tile"))) void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
}

// r[i] lane n = r[n] lane i, for 16 x 16 32-bit words (unpacks in 128-bit lanes, then two
// passes of 128-bit block shuffles).
__attribute__((target("avx512f"))) void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  // u[4k + j]'s 128-bit block L holds words 4L + j of rows 4k .. 4k + 3.
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// One task's keys: n keys from j0 of the prefix, in one KV head.
struct Chunk {
  const uint16_t* k;      // k_buf's first element of the head
  const uint16_t* v;      // v_buf's
  const int64_t* index;   // the prefix's slots, or null: slots start, start + 1, ...
  int64_t start, row_stride, j0, n, D;

  const uint16_t* key(const uint16_t* base, int64_t j) const {
    return j < n ? base + (index ? index[j0 + j] : start + j0 + j) * row_stride : nullptr;
  }
};

// kt [np / 16, D / 32, 16, 32]: B tiles of K^T; tile (b, dt) row i holds, for keys
// 16b .. 16b + 15, head-dim elements 32 dt + 2i and 32 dt + 2i + 1. Keys past n are zero.
__attribute__((target("avx512f"))) void pack_keys(const Chunk& c, int64_t np, uint16_t* kt) {
  const int64_t dts = c.D / 32;
  for (int64_t b = 0; b < np / 16; ++b) {
    const uint16_t* rows[16];
    for (int64_t n = 0; n < 16; ++n) rows[n] = c.key(c.k, b * 16 + n);
    for (int64_t dt = 0; dt < dts; ++dt) {
      __m512i r[16];
      for (int64_t n = 0; n < 16; ++n) r[n] = rows[n] ? _mm512_loadu_si512(rows[n] + dt * 32) : _mm512_setzero_si512();
      transpose16(r);
      uint16_t* tile = kt + (b * dts + dt) * kTileWords;
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(tile + i * 32, r[i]);
    }
  }
}

// vv [np / 32, D / 16, 16, 32]: B tiles of V; tile (b, dt) row i holds, for head-dim
// elements 16 dt .. 16 dt + 15, keys 32b + 2i and 32b + 2i + 1 side by side. Keys past n
// are zero (their probabilities are too, and 0 times a stale value could be NaN).
__attribute__((target("avx512f"))) void pack_values(const Chunk& c, int64_t np, uint16_t* vv) {
  const int64_t dts = c.D / 16;
  for (int64_t b = 0; b < np / kKeyBlock; ++b) {
    for (int64_t i = 0; i < 16; ++i) {
      const uint16_t* even = c.key(c.v, b * kKeyBlock + 2 * i);
      const uint16_t* odd = c.key(c.v, b * kKeyBlock + 2 * i + 1);
      for (int64_t dt = 0; dt < dts; ++dt) {
        const __m256i a = even ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + dt * 16)) : _mm256_setzero_si256();
        const __m256i o = odd ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + dt * 16)) : _mm256_setzero_si256();
        const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(o), 16));
        _mm512_storeu_si512(vv + ((b * dts + dt) * 16 + i) * 32, w);
      }
    }
  }
}

// s [QT * 16, ls] fp32 = q [QT * 16, D] . K^T over the chunk's nb key blocks (kt).
template <int QT>
__attribute__((target("amx-tile,amx-bf16"))) void scores(const uint16_t* q, int64_t D, const uint16_t* kt, int64_t nb,
                                                         float* s, int64_t ls) {
  const int64_t dts = D / 32, lds = ls * sizeof(float), ldq = D * sizeof(uint16_t);
  for (int64_t b = 0; b < nb; ++b) {  // score tiles of keys 32b .. 32b + 15 and 32b + 16 .. 32b + 31
    _tile_zero(0);
    _tile_zero(2);
    if constexpr (QT == 2) {
      _tile_zero(1);
      _tile_zero(3);
    }
    for (int64_t dt = 0; dt < dts; ++dt) {
      _tile_loadd(4, q + dt * 32, ldq);
      _tile_loadd(6, kt + (2 * b * dts + dt) * kTileWords, 64);
      _tile_loadd(7, kt + ((2 * b + 1) * dts + dt) * kTileWords, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 4, 7);
      if constexpr (QT == 2) {
        _tile_loadd(5, q + 16 * D + dt * 32, ldq);
        _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, s + b * kKeyBlock, lds);
    _tile_stored(2, s + b * kKeyBlock + 16, lds);
    if constexpr (QT == 2) {
      _tile_stored(1, s + 16 * ls + b * kKeyBlock, lds);
      _tile_stored(3, s + 16 * ls + b * kKeyBlock + 16, lds);
    }
  }
}

// acc [QT * 16, D] fp32 = p [QT * 16, lp] (bf16 probabilities) . V over nb key blocks (vv).
template <int QT>
__attribute__((target("amx-tile,amx-bf16"))) void values(const uint16_t* p, int64_t lp, const uint16_t* vv, int64_t nb,
                                                         int64_t D, float* acc) {
  const int64_t dts = D / 16, ldp = lp * sizeof(uint16_t), lda = D * sizeof(float);
  for (int64_t dt = 0; dt < dts; dt += 2) {
    _tile_zero(0);
    _tile_zero(2);
    if constexpr (QT == 2) {
      _tile_zero(1);
      _tile_zero(3);
    }
    for (int64_t b = 0; b < nb; ++b) {
      _tile_loadd(4, p + b * kKeyBlock, ldp);
      _tile_loadd(6, vv + (b * dts + dt) * kTileWords, 64);
      _tile_loadd(7, vv + (b * dts + dt + 1) * kTileWords, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 4, 7);
      if constexpr (QT == 2) {
        _tile_loadd(5, p + 16 * lp + b * kKeyBlock, ldp);
        _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, acc + dt * 16, lda);
    _tile_stored(2, acc + (dt + 1) * 16, lda);
    if constexpr (QT == 2) {
      _tile_stored(1, acc + 16 * D + dt * 16, lda);
      _tile_stored(3, acc + 16 * D + (dt + 1) * 16, lda);
    }
  }
}

// Without tiles: the same operands through vdpbf16ps. pair(x) broadcasts x[0], x[1] (a bf16
// pair) to every lane; a packed tile row is 16 lanes of pairs of the other operand.
__attribute__((target("avx512f,avx512bf16"))) inline __m512bh pair(const uint16_t* x) {
  int32_t w;
  std::memcpy(&w, x, sizeof(w));
  return (__m512bh)_mm512_set1_epi32(w);
}

// s [R, ls] fp32 = q [R, D] . K^T over the chunk's nb key blocks (kt), R query rows at a
// time against a block's two 16-key tiles: 2R accumulators, two key loads a pair.
template <int R>
__attribute__((target("avx512f,avx512bf16"))) void scores_vec(const uint16_t* q, int64_t D, const uint16_t* kt,
                                                             int64_t nb, float* s, int64_t ls) {
  const int64_t dts = D / 32;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 lo[R], hi[R];  // keys 32b .. 32b + 15, 32b + 16 .. 32b + 31
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t dt = 0; dt < dts; ++dt) {
      const uint16_t* t0 = kt + (2 * b * dts + dt) * kTileWords;
      const uint16_t* t1 = kt + ((2 * b + 1) * dts + dt) * kTileWords;
      for (int i = 0; i < 16; ++i) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(t0 + i * 32);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(t1 + i * 32);
        for (int r = 0; r < R; ++r) {
          const __m512bh a = pair(q + r * D + dt * 32 + 2 * i);
          lo[r] = _mm512_dpbf16_ps(lo[r], a, k0);
          hi[r] = _mm512_dpbf16_ps(hi[r], a, k1);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * ls + b * kKeyBlock, lo[r]);
      _mm512_storeu_ps(s + r * ls + b * kKeyBlock + 16, hi[r]);
    }
  }
}

// acc [R, D] columns 16 dt0 .. 16 (dt0 + C) fp32 = p [R, lp] . V over nb key blocks (vv):
// R x C accumulators held over the whole chunk, C value loads a key pair.
template <int R, int C>
__attribute__((target("avx512f,avx512bf16"))) void values_vec(const uint16_t* p, int64_t lp, const uint16_t* vv,
                                                             int64_t nb, int64_t D, int64_t dt0, float* acc) {
  const int64_t dts = D / 16;
  __m512 a[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < 16; ++i) {
      __m512bh v[C];
      for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vv + ((b * dts + dt0 + c) * 16 + i) * 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh pr = pair(p + r * lp + b * kKeyBlock + 2 * i);
        for (int c = 0; c < C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pr, v[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * D + (dt0 + c) * 16, a[r][c]);
  }
}

// For each of `rows` score rows (s, ls apart) over n keys (np with padding): the scaled
// scores' max m[r] and exp-sum l[r] (fp32), and the probabilities exp(score - m) in bf16
// into p (lp apart; zero past n).
__attribute__((target("avx512f,avx512bf16"))) void softmax_rows(float* s, int64_t ls, int64_t n, int64_t np, int64_t rows,
                                                              float scale, uint16_t* p, int64_t lp, float* m, float* l) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * ls;
    uint16_t* pr = p + r * lp;
    m[r] = srt_lite_attn::masked_scaled_max(sr, n, np, scale);
    // The lambda names its target itself: it does not take softmax_rows' (vcvtneps2bf16).
    l[r] = srt_lite_attn::exp_sum(sr, np, m[r], [pr](int64_t j, const Vec& e) __attribute__((target("avx512f,avx512bf16"))) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
    });
  }
}

// ---- one call: pack the queries, plan the chunks, attend each (KV head, chunk), merge -----

// The prefix's slots (null: prefix_len consecutive slots from prefix_start), each checked to
// address the pool.
const int64_t* prefix_slots(int64_t prefix_start, int64_t prefix_len, const at::Tensor& prefix_index, int64_t N) {
  if (prefix_start >= 0) {
    TORCH_CHECK(prefix_start + prefix_len <= N, "prefix_attention: prefix slots past the buffer");
    return nullptr;
  }
  TORCH_CHECK(prefix_index.scalar_type() == at::kLong && prefix_index.dim() == 1 && prefix_index.is_contiguous() &&
                  prefix_index.size(0) >= prefix_len,
              "prefix_attention: prefix_index must be a contiguous int64 [>= prefix_len]");
  const int64_t* index = prefix_index.data_ptr<int64_t>();
  for (int64_t j = 0; j < prefix_len; ++j) {
    TORCH_CHECK(index[j] >= 0 && index[j] < N, "prefix_attention: slot id ", index[j], " out of range [0, ", N, ")");
  }
  return index;
}

// How one call's work is split: M queries per KV head (padded to whole tiles), and the
// prefix in chunks of lc keys, one task per (KV head, chunk).
struct Plan {
  int64_t Hkv, D, M, Mpad, lc, chunks;
};

// Chunks: about eight tasks a thread, whole key blocks.
Plan plan_chunks(int64_t prefix_len, int64_t Hkv, int64_t D, int64_t M) {
  const int64_t threads = at::get_num_threads();
  int64_t lc = (prefix_len * Hkv + 8 * threads - 1) / (8 * threads);
  lc = std::clamp((lc + kKeyBlock - 1) / kKeyBlock * kKeyBlock, kMinChunkKeys, kMaxChunkKeys);
  return {Hkv, D, M, (M + 15) / 16 * 16, lc, (prefix_len + lc - 1) / lc};
}

// qh [Hkv, Mpad, D]: query t * G + g of KV head h is head h * G + g of token t; pad rows 0.
at::Tensor pack_queries(const at::Tensor& q, int64_t T, int64_t G, const Plan& pl) {
  const int64_t D = pl.D, Mpad = pl.Mpad;
  at::Tensor qh = at::zeros({pl.Hkv, Mpad, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  auto* qhp = reinterpret_cast<uint16_t*>(qh.data_ptr<c10::BFloat16>());
  for (int64_t h = 0; h < pl.Hkv; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(qhp + (h * Mpad + t * G) * D, qp + t * q.stride(0) + h * G * D, G * D * sizeof(uint16_t));
    }
  }
  return qh;
}

// A thread's buffers for one chunk, kept from call to call.
struct Scratch {
  std::vector<uint16_t> kt;  // [lc / 16, D / 32, 16, 32] K^T tiles
  std::vector<uint16_t> vv;  // [lc / 32, D / 16, 16, 32] V tiles
  std::vector<float> s;      // [32, lc] scores
  std::vector<uint16_t> p;   // [32, lc] probabilities
};

// One pass of up to kQueryBlock queries (qh rows from q) over a chunk's packed keys and
// values (np keys with padding): each query's max and exp-sum into m[i], l[i], its
// unnormalised output into acc [32, D].
struct Block {
  const uint16_t* q;
  int64_t real;  // the block's queries; its rows past them are padding
  bool two;      // rows past 16 exist (a second tile of queries)
  float* m;
  float* l;
  float* acc;
};

void attend_block_tiles(const Block& b, const Chunk& ch, int64_t np, int64_t lc, float scale, Scratch& sc) {
  const int64_t nb = np / kKeyBlock;
  if (b.two) {
    scores<2>(b.q, ch.D, sc.kt.data(), nb, sc.s.data(), lc);
  } else {
    scores<1>(b.q, ch.D, sc.kt.data(), nb, sc.s.data(), lc);
  }
  softmax_rows(sc.s.data(), lc, ch.n, np, b.real, scale, sc.p.data(), lc, b.m, b.l);
  if (b.two) {
    values<2>(sc.p.data(), lc, sc.vv.data(), nb, ch.D, b.acc);
  } else {
    values<1>(sc.p.data(), lc, sc.vv.data(), nb, ch.D, b.acc);
  }
}

// Vectors need no whole tiles: rows go 8 (scores) and 4 (values) at a time, and the rows
// past `real` up to a multiple of 8 are qh's zero padding.
void attend_block_vectors(const Block& b, const Chunk& ch, int64_t np, int64_t lc, float scale, Scratch& sc) {
  const int64_t nb = np / kKeyBlock, D = ch.D;
  const int64_t rows = (b.real + 7) / 8 * 8;
  for (int64_t r = 0; r < rows; r += 8) scores_vec<8>(b.q + r * D, D, sc.kt.data(), nb, sc.s.data() + r * lc, lc);
  softmax_rows(sc.s.data(), lc, ch.n, np, b.real, scale, sc.p.data(), lc, b.m, b.l);
  for (int64_t r = 0; r < b.real; r += 4) {
    int64_t dt = 0;
    for (; dt + 4 <= D / 16; dt += 4) values_vec<4, 4>(sc.p.data() + r * lc, lc, sc.vv.data(), nb, D, dt, b.acc + r * D);
    if (dt < D / 16) values_vec<4, 2>(sc.p.data() + r * lc, lc, sc.vv.data(), nb, D, dt, b.acc + r * D);
  }
}

// Every (KV head, chunk) task: its keys and values packed once, then every query against
// them. Writes each task's partial result: acc [Hkv, chunks, Mpad, D] unnormalised outputs,
// ml [Hkv, chunks, (max, exp-sum), Mpad].
void attend_chunks(const Plan& pl, const uint16_t* qh, const uint16_t* kb, const uint16_t* vb, const int64_t* index,
                   int64_t prefix_start, int64_t prefix_len, float scale, bool tiles, float* acc, float* ml) {
  const int64_t D = pl.D, Mpad = pl.Mpad, lc = pl.lc, chunks = pl.chunks;
  at::parallel_for(0, pl.Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    static thread_local Scratch sc;
    sc.kt.resize(lc * D);
    sc.vv.resize(lc * D);
    sc.s.resize(kQueryBlock * lc);
    sc.p.resize(kQueryBlock * lc);
    if (tiles) configure();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / chunks, c = task % chunks;
      const Chunk ch{kb + h * D, vb + h * D, index, prefix_start, pl.Hkv * D, c * lc, std::min(lc, prefix_len - c * lc), D};
      const int64_t np = (ch.n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
      pack_keys(ch, np, sc.kt.data());
      pack_values(ch, np, sc.vv.data());
      float* m = ml + (h * chunks + c) * 2 * Mpad;
      for (int64_t q0 = 0; q0 < Mpad; q0 += kQueryBlock) {
        const Block b{qh + (h * Mpad + q0) * D, std::min(kQueryBlock, pl.M - q0), Mpad - q0 > 16, m + q0, m + Mpad + q0,
                      acc + ((h * chunks + c) * Mpad + q0) * D};
        if (tiles) {
          attend_block_tiles(b, ch, np, lc, scale, sc);
        } else {
          attend_block_vectors(b, ch, np, lc, scale, sc);
        }
      }
    }
    if (tiles) release_tiles();
  });
}

// The chunks' partial results merged per query: o [1, Hkv, M, D] fp32 and lse [1, Hkv, M] of
// the scaled scores, as flash attention returns them.
void merge_chunks(const Plan& pl, const float* acc, const float* ml, at::Tensor& o, at::Tensor& lse) {
  const int64_t D = pl.D, M = pl.M, Mpad = pl.Mpad, chunks = pl.chunks;
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  o = at::empty({1, pl.Hkv, M, D}, f32);
  lse = at::empty({1, pl.Hkv, M}, f32);
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, pl.Hkv * M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(chunks);
    for (int64_t hr = begin; hr < end; ++hr) {
      const int64_t h = hr / M, r = hr % M;
      const float* m = ml + h * chunks * 2 * Mpad + r;
      lp[hr] = srt_lite_attn::merge_parts(chunks, m, m + Mpad, 2 * Mpad, acc + (h * chunks * Mpad + r) * D, Mpad * D, D,
                                          w.data(), op + hr * D);
    }
  });
}
#endif

}  // namespace

void allow_kernels(bool tiles, bool vectors) {
  tiles_allowed = tiles;
  vectors_allowed = vectors;
}

bool bf16_vectors_allowed() { return vectors_allowed && __builtin_cpu_supports("avx512bf16"); }

bool attention(const at::Tensor& q, int64_t T, int64_t G, const at::Tensor& k_buf, const at::Tensor& v_buf,
               int64_t prefix_start, int64_t prefix_len, const at::Tensor& prefix_index, double scale, at::Tensor& o,
               at::Tensor& lse, Kernel kernel) {
#ifdef SRT_LITE_HAVE_AMX
  const int64_t N = k_buf.size(0), Hkv = k_buf.size(1), D = k_buf.size(2);
  const bool can_tile = tiles_allowed && srt_lite_amx::supported();
  const bool can_vec = bf16_vectors_allowed();
  if (kernel == Kernel::kAuto) kernel = can_tile ? Kernel::kTiles : Kernel::kVectors;
  if (!(kernel == Kernel::kTiles ? can_tile : can_vec) || q.scalar_type() != at::kBFloat16 ||
      k_buf.scalar_type() != at::kBFloat16 || D % 32 != 0 || D > 256 || prefix_len <= 0 || T <= 0) {
    return false;
  }
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && v_buf.sizes() == k_buf.sizes() &&
                  v_buf.scalar_type() == at::kBFloat16,
              "prefix_attention: KV buffers must be contiguous bf16 [N, Hkv, D]");
  TORCH_CHECK(q.dim() == 2 && q.size(0) >= T && q.size(1) == Hkv * G * D && q.stride(1) == 1,
              "prefix_attention: q must be [>= T, H * D] with contiguous rows");
  const int64_t* index = prefix_slots(prefix_start, prefix_len, prefix_index, N);
  const Plan pl = plan_chunks(prefix_len, Hkv, D, T * G);
  const at::Tensor qh = pack_queries(q, T, G, pl);
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor part_acc = at::empty({Hkv, pl.chunks, pl.Mpad, D}, f32);  // [Hkv, chunks, Mpad, D] unnormalised outputs
  at::Tensor part_ml = at::empty({Hkv, pl.chunks, 2, pl.Mpad}, f32);   // [Hkv, chunks, (max, exp-sum), Mpad]
  attend_chunks(pl, reinterpret_cast<const uint16_t*>(qh.data_ptr<c10::BFloat16>()),
                reinterpret_cast<const uint16_t*>(k_buf.data_ptr<c10::BFloat16>()),
                reinterpret_cast<const uint16_t*>(v_buf.data_ptr<c10::BFloat16>()), index, prefix_start, prefix_len,
                static_cast<float>(scale), kernel == Kernel::kTiles, part_acc.data_ptr<float>(), part_ml.data_ptr<float>());
  merge_chunks(pl, part_acc.data_ptr<float>(), part_ml.data_ptr<float>(), o, lse);
  return true;
#else
  (void)q, (void)T, (void)G, (void)k_buf, (void)v_buf, (void)prefix_start, (void)prefix_len, (void)prefix_index,
      (void)scale, (void)o, (void)lse, (void)kernel;
  return false;
#endif
}

}  // namespace srt_lite_prefix

namespace {

// The kernel as an op of its own, for tests: (o [1, Hkv, T * G, D] fp32, lse [1, Hkv, T * G])
// from the tiles (tiles true) or the vectors.
std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q, int64_t T, int64_t G, const at::Tensor& k_buf,
                                                    const at::Tensor& v_buf, int64_t prefix_start, int64_t prefix_len,
                                                    const at::Tensor& prefix_index, double scale, bool tiles) {
  TORCH_CHECK(k_buf.dim() == 3, "prefix_attention: KV buffers must be [N, Hkv, D]");
  at::Tensor o, lse;
  const auto kernel = tiles ? srt_lite_prefix::Kernel::kTiles : srt_lite_prefix::Kernel::kVectors;
  TORCH_CHECK(srt_lite_prefix::attention(q, T, G, k_buf, v_buf, prefix_start, prefix_len, prefix_index, scale, o, lse,
                                         kernel),
              "prefix_attention: needs ", tiles ? "AMX" : "AVX512-BF16",
              " (allowed by SRT_LITE_CPU_CAPS), bf16, head_dim a multiple of 32 up to 256, and a prefix");
  return {o, lse};
}

void allow_prefix_kernels(bool tiles, bool vectors) { srt_lite_prefix::allow_kernels(tiles, vectors); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def("prefix_attention(Tensor q, int T, int G, Tensor k_buf, Tensor v_buf, int prefix_start, int prefix_len, "
        "Tensor prefix_index, float scale, bool tiles) -> (Tensor, Tensor)");
  m.def("allow_prefix_kernels(bool tiles, bool vectors) -> ()");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) { m.impl("prefix_attention", &prefix_attention); }

TORCH_LIBRARY_IMPL(srt_lite_cpu, CompositeExplicitAutograd, m) {
  m.impl("allow_prefix_kernels", &allow_prefix_kernels);
}
