// CPU attention for the torch_native backend's hottest path, one call per layer and step.
//
// A decode or verify step whose rows share a long prefix (many requests on one common
// prompt) runs cascade attention in every layer: store the new tokens' K/V, one attention
// over the shared prefix (all queries as one sequence), each row's own
// suffix attended exactly, and a log-sum-exp merge. Written with torch's Python ops
// (layers/attention/cascade.py, TokenCascadePlan, which attends the suffixes as one masked
// sequence) that is dozens of calls a layer whose dispatch costs more than their work when
// a step has few tokens; here it is one call (CppCascadePlan in layers/attention/steps.py).
// The K/V row copies are small, so they are plain loops instead of index_copy_ /
// index_select, whose set-up would dominate. The suffix loops use ATen's at::vec, built for
// AVX-512 where the CPU has it (cpu_kernels.py picks the flags).
// Built on first use by srt_lite/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_ops.h"
#include "cpu_prefix_attention.h"

namespace {

// Row ids must address the buffer: a bad id would write outside it.
void check_ids(const at::Tensor& ids, int64_t n, int64_t rows) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "slot ids: contiguous int64 [n]");
  TORCH_CHECK(ids.size(0) >= n, "fewer slot ids than rows");
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < rows, "slot id ", p[i], " out of range [0, ", rows, ")");
  }
}

// buf[loc[t]] = src[t] for t < n; buf [N, Hkv, D] contiguous, src [>= n, Hkv * D] with
// contiguous rows (k, or v as a strided view of the fused qkv output).
void store_rows(at::Tensor& buf, const at::Tensor& loc, const at::Tensor& src, int64_t n) {
  const int64_t width = buf.size(1) * buf.size(2);
  if (!buf.is_contiguous() || src.dim() != 2 || src.size(1) != width || src.stride(1) != 1 ||
      src.scalar_type() != buf.scalar_type()) {
    buf.index_copy_(0, loc.narrow(0, 0, n), src.narrow(0, 0, n).view({n, buf.size(1), buf.size(2)}).to(buf.scalar_type()));
    return;
  }
  check_ids(loc, n, buf.size(0));
  const int64_t row_bytes = width * buf.element_size();
  const int64_t* ids = loc.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(buf.data_ptr());
  const auto* from = static_cast<const char*>(src.data_ptr());
  const int64_t src_step = src.stride(0) * src.element_size();
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(dst + ids[t] * row_bytes, from + t * src_step, row_bytes);
  }
}

// buf[index] as [S, Hkv, D] (buf contiguous).
at::Tensor gather_rows(const at::Tensor& buf, const at::Tensor& index) {
  const int64_t n = index.size(0);
  check_ids(index, n, buf.size(0));
  at::Tensor out = at::empty({n, buf.size(1), buf.size(2)}, buf.options());
  const int64_t row_bytes = buf.size(1) * buf.size(2) * buf.element_size();
  const int64_t* ids = index.data_ptr<int64_t>();
  const auto* src = static_cast<const char*>(buf.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * row_bytes, src + ids[i] * row_bytes, row_bytes);
  }
  return out;
}

// Checks a cascade's row offsets: q_off [B + 1] and k_off [B + 1] (int64, ascending from 0)
// split the T queries and the S suffix keys row by row, and a row has at least as many keys
// as queries (its new tokens are the last of its suffix).
void check_offsets(const at::Tensor& q_off, const at::Tensor& k_off, int64_t T, int64_t S) {
  TORCH_CHECK(q_off.scalar_type() == at::kLong && k_off.scalar_type() == at::kLong && q_off.dim() == 1 &&
      q_off.is_contiguous() && k_off.is_contiguous() && k_off.sizes() == q_off.sizes() && q_off.size(0) >= 2,
      "row offsets: contiguous int64 [B + 1]");
  const int64_t B = q_off.size(0) - 1;
  const int64_t* qo = q_off.data_ptr<int64_t>();
  const int64_t* ko = k_off.data_ptr<int64_t>();
  TORCH_CHECK(qo[0] == 0 && ko[0] == 0 && qo[B] == T && ko[B] == S, "row offsets must span the queries and keys");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t = qo[b + 1] - qo[b], k = ko[b + 1] - ko[b];
    TORCH_CHECK(t >= 1 && k >= t, "row ", b, ": ", t, " queries over ", k, " suffix keys");
  }
}

using Vec = at::vec::Vectorized<float>;

// dst[0..n) = float(src[0..n)) * mul; plain loops the compiler vectorizes.
inline void to_float(float* dst, const float* src, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = src[i] * mul;
  }
}

inline void to_float(float* dst, const c10::BFloat16* src, int64_t n, float mul) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;  // bf16 is a float's high half
    float f;
    std::memcpy(&f, &word, sizeof(f));
    dst[i] = f * mul;
  }
}

// One float vector of the head dimension, from T's storage.
inline Vec load_vec(const float* p) { return Vec::loadu(p); }
inline Vec load_vec(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_to_float<c10::BFloat16>(p, v);
  return v;
}

// Queries attended together in one pass over a row's keys: each key is loaded once for
// all of them (a decode row's G query heads of one KV head), and QR x kVChunk value
// accumulators plus the loaded vectors fit AVX-512's 32 registers.
constexpr int64_t kQRows = 4;
constexpr int64_t kVChunk = 4;  // head-dim vectors of V accumulated at once
// Keys ahead whose K and V lines are prefetched: a row's slots are scattered through the
// pool, so the hardware prefetcher cannot see the next key coming, and a decode step's
// keys come from memory, not cache. The distance was chosen by measurement
// (docs/development.md, batched decode).
constexpr int64_t kPrefetchKeys = 32;

// Asks for the `bytes` at p (one key's head) ahead of their use.
inline void prefetch_head(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// acc[r][0..NV*W) += sum_j p[r][j] * v_j[0..NV*W) over keys j < n for QR queries, with V read
// straight from the pool (widened in registers, no copy).
template <typename T, int64_t QR, int64_t NV>
void value_chunk(const T* vb, const int64_t* slots, int64_t row_stride, int64_t n, const float* p, int64_t ps,
                 float* const* acc) {
  constexpr int64_t W = Vec::size();
  Vec a[QR][NV];
  for (int64_t r = 0; r < QR; ++r) {
    for (int64_t c = 0; c < NV; ++c) a[r][c] = Vec(0.f);
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = vb + slots[j] * row_stride;
    // Already cached by the score pass's prefetch unless the row is too long for its V to
    // stay in cache; asking again costs little then and keeps long rows streaming.
    if (j + kPrefetchKeys < n) prefetch_head(vb + slots[j + kPrefetchKeys] * row_stride, NV * W * sizeof(T));
    Vec v[NV];
    for (int64_t c = 0; c < NV; ++c) v[c] = load_vec(vj + c * W);
    for (int64_t r = 0; r < QR; ++r) {
      const Vec pr(p[r * ps + j]);
      for (int64_t c = 0; c < NV; ++c) a[r][c] = at::vec::fmadd(pr, v[c], a[r][c]);
    }
  }
  for (int64_t r = 0; r < QR; ++r) {
    for (int64_t c = 0; c < NV; ++c) a[r][c].store(acc[r] + c * W);
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
#define SRT_LITE_BF16_SCORES 1
// s[r * ps + j] = scale * (q_r . k_j) for keys j < nmax, in AVX512-BF16 dot products: q_r
// (qf[r] unscaled, so exact in bf16: the pool's dtype) against each key as it lies in the
// pool, one horizontal sum per key, then the scale. Half the multiplies of the fp32 loop, and
// the keys are not widened. DC: D / 32.
template <int64_t QR, int64_t DC>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
void bf16_scores(const float* const* qf, int64_t nmax, const uint16_t* kb, const uint16_t* vb, const int64_t* slots,
                 int64_t row_stride, float scale, float* s, int64_t ps) {
  constexpr int64_t D = 32 * DC;
  __m512bh qb[QR][DC];  // the queries in registers: DC vectors of 32 bf16 each
  for (int64_t r = 0; r < QR; ++r) {
    for (int64_t c = 0; c < DC; ++c) qb[r][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qf[r] + 32 * c + 16), _mm512_loadu_ps(qf[r] + 32 * c));
  }
  for (int64_t j = 0; j < nmax; ++j) {
    const uint16_t* kj = kb + slots[j] * row_stride;
    if (j + kPrefetchKeys < nmax) {
      prefetch_head(kb + slots[j + kPrefetchKeys] * row_stride, D * sizeof(uint16_t));
      prefetch_head(vb + slots[j + kPrefetchKeys] * row_stride, D * sizeof(uint16_t));
    }
    __m512 a[QR];
    for (int64_t r = 0; r < QR; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < DC; ++c) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kj + 32 * c);
      for (int64_t r = 0; r < QR; ++r) a[r] = _mm512_dpbf16_ps(a[r], qb[r][c], k);
    }
    for (int64_t r = 0; r < QR; ++r) s[r * ps + j] = _mm512_reduce_add_ps(a[r]) * scale;
  }
}

// bf16_scores for a head size D: a multiple of 32 up to 256 (bf16_scores_on).
template <int64_t QR>
void bf16_scores_any(const float* const* qf, int64_t nmax, const uint16_t* kb, const uint16_t* vb, const int64_t* slots,
                     int64_t row_stride, int64_t D, float scale, float* s, int64_t ps) {
  switch (D / 32) {
    case 1: return bf16_scores<QR, 1>(qf, nmax, kb, vb, slots, row_stride, scale, s, ps);
    case 2: return bf16_scores<QR, 2>(qf, nmax, kb, vb, slots, row_stride, scale, s, ps);
    case 3: return bf16_scores<QR, 3>(qf, nmax, kb, vb, slots, row_stride, scale, s, ps);
    case 4: return bf16_scores<QR, 4>(qf, nmax, kb, vb, slots, row_stride, scale, s, ps);
    case 5: return bf16_scores<QR, 5>(qf, nmax, kb, vb, slots, row_stride, scale, s, ps);
    case 6: return bf16_scores<QR, 6>(qf, nmax, kb, vb, slots, row_stride, scale, s, ps);
    case 7: return bf16_scores<QR, 7>(qf, nmax, kb, vb, slots, row_stride, scale, s, ps);
    default: return bf16_scores<QR, 8>(qf, nmax, kb, vb, slots, row_stride, scale, s, ps);
  }
}
#endif

// Whether suffix_row scores a T pool's keys in bf16 dot products (bf16_scores): decided by
// the dtype, the head size and the CPU alone, never by the batch, so every query of a
// process is scored the same way.
template <typename T>
bool bf16_scores_on(int64_t D) {
#ifdef SRT_LITE_BF16_SCORES
  return std::is_same_v<T, c10::BFloat16> && D % 32 == 0 && srt_lite_prefix::bf16_vectors_allowed();
#else
  return false;
#endif
}

// Softmax attention of QR queries (fp32, pre-scaled, qf[r] [D]) over the first n[r] keys at
// `slots` of one KV head (kb / vb point at that head's first element; rows row_stride
// apart). Writes the unnormalised output to acc[r] [D] and returns each query's max score
// and exp-sum in m[r], l[r]. s: scratch [QR, ps] for the scores, ps >= max n rounded up to W.
// Keys are read from the pool directly: gathering and widening them first cost more than
// the arithmetic. dots (bf16_scores_on): qf is unscaled and the scores are bf16_scores'.
template <typename T, int64_t QR>
void attend_queries(const float* const* qf, const int64_t* n, const T* kb, const T* vb, const int64_t* slots,
                    int64_t row_stride, int64_t D, float* s, int64_t ps, float* const* acc, float* m, float* l,
                    bool dots, float scale) {
  constexpr int64_t W = Vec::size();
  int64_t nmax = 0;
  for (int64_t r = 0; r < QR; ++r) nmax = std::max(nmax, n[r]);
  // Each key's K and V lines are asked for kPrefetchKeys keys ahead of the score pass, the
  // first ones all at once before it: a task's keys start cold, and without this both
  // passes waited on their first keys one by one. The value pass then mostly reads V from
  // cache.
  for (int64_t j = 0; j < std::min(nmax, kPrefetchKeys); ++j) {
    prefetch_head(kb + slots[j] * row_stride, D * sizeof(T));
    prefetch_head(vb + slots[j] * row_stride, D * sizeof(T));
  }
#ifdef SRT_LITE_BF16_SCORES
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (dots) {
      bf16_scores_any<QR>(qf, nmax, reinterpret_cast<const uint16_t*>(kb), reinterpret_cast<const uint16_t*>(vb), slots,
                          row_stride, D, scale, s, ps);
    }
  }
#endif
  for (int64_t j = 0; j < nmax && !dots; ++j) {
    const T* kj = kb + slots[j] * row_stride;
    if (j + kPrefetchKeys < nmax) {
      prefetch_head(kb + slots[j + kPrefetchKeys] * row_stride, D * sizeof(T));
      prefetch_head(vb + slots[j + kPrefetchKeys] * row_stride, D * sizeof(T));
    }
    Vec a[QR];
    for (int64_t r = 0; r < QR; ++r) a[r] = Vec(0.f);
    for (int64_t d = 0; d < D; d += W) {
      const Vec kv = load_vec(kj + d);
      for (int64_t r = 0; r < QR; ++r) a[r] = at::vec::fmadd(Vec::loadu(qf[r] + d), kv, a[r]);
    }
    for (int64_t r = 0; r < QR; ++r) s[r * ps + j] = srt_lite_attn::reduce_sum(a[r]);
  }
  const int64_t np = (nmax + W - 1) / W * W;
  for (int64_t r = 0; r < QR; ++r) {
    const srt_lite_attn::RowSums sums = srt_lite_attn::softmax_row(s + r * ps, n[r], np);
    m[r] = sums.max;
    l[r] = sums.sum;
  }
  // Keys past a query's position weigh exp(-inf) = 0, so all queries run to nmax.
  int64_t d = 0;
  float* out[QR];
  for (; d + kVChunk * W <= D; d += kVChunk * W) {
    for (int64_t r = 0; r < QR; ++r) out[r] = acc[r] + d;
    value_chunk<T, QR, kVChunk>(vb + d, slots, row_stride, nmax, s, ps, out);
  }
  for (; d < D; d += W) {
    for (int64_t r = 0; r < QR; ++r) out[r] = acc[r] + d;
    value_chunk<T, QR, 1>(vb + d, slots, row_stride, nmax, s, ps, out);
  }
}

template <typename T>
void attend_any(int64_t qr, const float* const* qf, const int64_t* n, const T* kb, const T* vb, const int64_t* slots,
                int64_t row_stride, int64_t D, float* s, int64_t ps, float* const* acc, float* m, float* l, bool dots,
                float scale) {
  switch (qr) {
    case 1: return attend_queries<T, 1>(qf, n, kb, vb, slots, row_stride, D, s, ps, acc, m, l, dots, scale);
    case 2: return attend_queries<T, 2>(qf, n, kb, vb, slots, row_stride, D, s, ps, acc, m, l, dots, scale);
    case 3: return attend_queries<T, 3>(qf, n, kb, vb, slots, row_stride, D, s, ps, acc, m, l, dots, scale);
    default: return attend_queries<T, 4>(qf, n, kb, vb, slots, row_stride, D, s, ps, acc, m, l, dots, scale);
  }
}

// The suffix part of a token cascade and its merge with the prefix part, for one row and
// KV head. Each query attends to its own row's suffix keys up to its position, computed
// here exactly (no padding, no mask: a masked flash call over all rows' suffixes computes B
// times the pairs), and is merged with its prefix output o_pre / lse_pre by log-sum-exp.
// The row's nq * G queries go kQRows at a time. Scratch: qf [kQRows, D], s [kQRows, ps],
// acc [kQRows, D], with ps = k rounded up to the vector width. dots: bf16_scores_on<T>(D),
// decided once per call so that every task of a step scores the same way.
template <typename T>
void suffix_row(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const int64_t* slots, int64_t q0,
    int64_t nq, int64_t k, int64_t h, int64_t G, float scale, const at::Tensor& o_pre, const at::Tensor& lse_pre,
    at::Tensor& out, float* scratch, int64_t ps, bool dots) {
  const int64_t D = k_buf.size(2), Hkv = k_buf.size(1), row_stride = Hkv * D;
  const T* kb = k_buf.data_ptr<T>() + h * D;
  const T* vb = v_buf.data_ptr<T>() + h * D;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // No prefix part (a batch of rows with nothing shared): the suffix is all there is.
  // o_pre is fp32 (srt_lite_prefix::attention) or T (flash attention).
  const bool pre_f32 = o_pre.defined() && o_pre.scalar_type() == at::kFloat;
  const void* pre = o_pre.defined() ? o_pre.data_ptr() : nullptr;
  const float* lse = lse_pre.defined() ? lse_pre.data_ptr<float>() : nullptr;
  float* qbuf = scratch;
  float* s = qbuf + kQRows * D;
  float* abuf = s + kQRows * ps;
  const float* qf[kQRows];
  float* acc[kQRows];
  int64_t n[kQRows], toks[kQRows], gs[kQRows];
  float m[kQRows], l[kQRows], pre_f[256];  // [D]; D <= 256 is checked by the caller
  const int64_t total = nq * G;
  for (int64_t first = 0; first < total; first += kQRows) {
    const int64_t qr = std::min(kQRows, total - first);
    for (int64_t r = 0; r < qr; ++r) {
      const int64_t i = (first + r) / G, g = (first + r) % G;
      toks[r] = q0 + i;
      gs[r] = g;
      n[r] = k - nq + i + 1;  // keys visible to the row's i-th query
      to_float(qbuf + r * D, qp + toks[r] * q.stride(0) + (h * G + g) * D, D, dots ? 1.f : scale);
      qf[r] = qbuf + r * D;
      acc[r] = abuf + r * D;
    }
    attend_any<T>(qr, qf, n, kb, vb, slots, row_stride, D, s, ps, acc, m, l, dots, scale);
    for (int64_t r = 0; r < qr; ++r) {
      const int64_t tok = toks[r], head = h * G + gs[r], row = tok * G + gs[r];  // row: the query's index in KV head h
      // Softmax over both key sets: the prefix's share of the mass is sigmoid(lse_pre - lse_suf).
      const float lse_suf = srt_lite_attn::part_lse(m[r], l[r]);
      float w_suf = 1.f / l[r];
      if (pre != nullptr) {
        const float w_pre = srt_lite_attn::first_share(lse[h * lse_pre.stride(1) + row * lse_pre.stride(2)], lse_suf);
        w_suf = (1.f - w_pre) / l[r];
        const int64_t at_row = h * o_pre.stride(1) + row * o_pre.stride(2);
        if (pre_f32) {
          to_float(pre_f, static_cast<const float*>(pre) + at_row, D, w_pre);
        } else {
          to_float(pre_f, static_cast<const T*>(pre) + at_row, D, w_pre);
        }
      } else {
        std::memset(pre_f, 0, D * sizeof(float));
      }
      T* dst = op + tok * out.stride(0) + head * D;
      for (int64_t d = 0; d < D; ++d) {
        dst[d] = static_cast<T>(pre_f[d] + w_suf * acc[r][d]);
      }
    }
  }
}

// Queries of one row that one task attends: a prompt's hundreds of queries are split so the
// threads share a layer's few (row, KV head) pairs; each query's result is its own, whatever
// task computes it.
constexpr int64_t kQueryBlock = 32;

struct SuffixTask {
  int64_t b, h, i0, i1;  // row b's queries [i0, i1) of KV head h
  int64_t cost;          // query-key pairs
};

// Every (row, KV head, block) task, the costliest first: threads claim them as they come
// free, so the long causal blocks do not end up last on one thread.
std::vector<SuffixTask> suffix_tasks(const int64_t* qo, const int64_t* ko, int64_t B, int64_t Hkv) {
  std::vector<SuffixTask> tasks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qo[b + 1] - qo[b], nk = ko[b + 1] - ko[b];
    for (int64_t i0 = 0; i0 < nq; i0 += kQueryBlock) {
      const int64_t i1 = std::min(nq, i0 + kQueryBlock);
      const int64_t seen = nk - nq + i1;  // keys of the block's last query
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({b, h, i0, i1, (i1 - i0) * seen});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const SuffixTask& x, const SuffixTask& y) { return x.cost > y.cost; });
  return tasks;
}

// One layer of cascade attention for T query tokens (a batch's short rows over a prefix
// they all share). q [>= T, H * D], k and v [>= T, Hkv * D] (rows past T only pad the
// token axis), stored at slots loc [T] of k_buf / v_buf [N, Hkv, D]. The prefix is
// prefix_len slots starting at prefix_start, or the slots prefix_index [Lp] when
// prefix_start < 0; suffix_index [S] lists every row's own slots, row after row, and
// q_off / k_off [B + 1] where each row's queries and suffix keys start (check_offsets).
// Writes the result into out [>= T, H * D] (rows T.. are left as they are).
void cascade_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_buf, at::Tensor v_buf,
    const at::Tensor& loc, const at::Tensor& suffix_index, const at::Tensor& q_off, const at::Tensor& k_off,
    int64_t prefix_start, int64_t prefix_len, const at::Tensor& prefix_index, int64_t num_heads, double scale,
    at::Tensor out) {
  const int64_t T = loc.size(0), Hkv = k_buf.size(1), D = k_buf.size(2), G = num_heads / Hkv;
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes() && k_buf.is_contiguous() && v_buf.is_contiguous() &&
      num_heads % Hkv == 0, "KV buffers: contiguous [N, Hkv, D]");
  TORCH_CHECK(q.size(0) >= T && q.size(1) == num_heads * D && q.stride(1) == 1 && out.size(0) >= T &&
      out.size(1) == num_heads * D && out.stride(1) == 1, "q / out [T, H * D] with contiguous rows");
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && k_buf.scalar_type() == dtype &&
      out.scalar_type() == dtype && D % Vec::size() == 0 && D <= 256, "bf16 or fp32 throughout, head_dim a multiple of ",
      Vec::size(), " up to 256");
  const int64_t S = suffix_index.size(0);
  check_offsets(q_off, k_off, T, S);
  check_ids(suffix_index, S, k_buf.size(0));
  if (k.size(0) > 0) {  // k and v without rows: a group of a larger step, whose KV is stored
    store_rows(k_buf, loc, k, T);
    store_rows(v_buf, loc, v, T);
  }
  // Prefix: every query (row t * G + g of KV head h is head h * G + g of token t) sees it all.
  // Without one (prefix_len 0: decode rows that share nothing) the rows' own keys are all.
  at::Tensor o_pre, lse_pre;
  // CPUs with bf16 products in hardware (AMX, AVX512-BF16) and bf16 KV take our kernel (fp32
  // output); the others flash attention.
  if (prefix_len > 0 && !srt_lite_prefix::attention(q, T, G, k_buf, v_buf, prefix_start, prefix_len, prefix_index,
                                                    scale, o_pre, lse_pre)) {
    at::Tensor q_seq = q.narrow(0, 0, T).view({T, Hkv, G, D}).transpose(0, 1).reshape({1, Hkv, T * G, D});
    at::Tensor k_pre, v_pre;
    if (prefix_start >= 0) {
      k_pre = k_buf.narrow(0, prefix_start, prefix_len);
      v_pre = v_buf.narrow(0, prefix_start, prefix_len);
    } else {
      k_pre = gather_rows(k_buf, prefix_index);
      v_pre = gather_rows(v_buf, prefix_index);
    }
    k_pre = k_pre.view({1, prefix_len, Hkv, D}).transpose(1, 2);  // [1, Hkv, Lp, D]
    v_pre = v_pre.view({1, prefix_len, Hkv, D}).transpose(1, 2);
    std::tie(o_pre, lse_pre) = at::_scaled_dot_product_flash_attention_for_cpu(q_seq, k_pre, v_pre, 0.0, false, std::nullopt, scale);
    TORCH_CHECK(o_pre.stride(3) == 1 && lse_pre.scalar_type() == at::kFloat, "flash output layout");
  }
  // Suffixes, merged into out: one task per (row, KV head, block of the row's queries).
  const int64_t B = q_off.size(0) - 1;
  const int64_t* qo = q_off.data_ptr<int64_t>();
  const int64_t* ko = k_off.data_ptr<int64_t>();
  const int64_t* slots = suffix_index.data_ptr<int64_t>();
  int64_t max_k = 0;
  for (int64_t b = 0; b < B; ++b) {
    max_k = std::max(max_k, ko[b + 1] - ko[b]);
  }
  const std::vector<SuffixTask> tasks = suffix_tasks(qo, ko, B, Hkv);
  const bool dots = dtype == at::kBFloat16 && bf16_scores_on<c10::BFloat16>(D);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const int64_t ps = (max_k + Vec::size() - 1) / Vec::size() * Vec::size();
    std::vector<float> scratch(kQRows * (2 * D + ps));  // see suffix_row
    auto* row = dtype == at::kBFloat16 ? &suffix_row<c10::BFloat16> : &suffix_row<float>;
    for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(tasks.size());) {
      const SuffixTask& t = tasks[i];
      // The block's queries [i0, i1) of the row's nq: the last of them sees all but the
      // row's nq - i1 last keys.
      const int64_t nq = qo[t.b + 1] - qo[t.b], nk = ko[t.b + 1] - ko[t.b];
      row(
          q, k_buf, v_buf, slots + ko[t.b], qo[t.b] + t.i0, t.i1 - t.i0, nk - nq + t.i1, t.h, G,
          static_cast<float>(scale), o_pre, lse_pre, out, scratch.data(), ps, dots);
    }
  });
}

// The compiled graph's attention (`srt_lite_cpu::attention`): a step whose attention is one
// token cascade runs in C++ without any Python; every other step goes to the Python op
// `srt_lite::attention` through the dispatcher.
//
// The step's metadata cannot reach the op as arguments: the graph was traced once with the
// op's signature (q, k, v, layer id), and rows, offsets and the prefix change every step.
// So the step is set here before the forward (set_cascade_step, from CppCascadePlan's
// compiled_step) and cleared after it, as the Python op reads its batch from
// layers/radix_attention.py's forward context. It is one per thread, the thread that runs
// the forward: the graph calls the op on the thread that called the graph.
struct CascadeStep {
  at::Tensor loc, suffix_index, q_off, k_off, prefix_index;
  int64_t prefix_start = -1, prefix_len = 0, num_heads = 0;
  double scale = 1.0;
  std::vector<at::Tensor> k_bufs, v_bufs;  // by layer id
};

// The step being run, if any: set once before a forward, cleared after it.
class CurrentCascadeStep {
 public:
  void set(CascadeStep step) {
    TORCH_CHECK(!step_, "set_cascade_step: the previous step was not cleared");
    step_ = std::move(step);
  }
  void clear() { step_.reset(); }
  bool is_set() const { return step_.has_value(); }
  const CascadeStep& get() const {
    TORCH_CHECK(step_, "srt_lite_cpu::attention: no cascade step is set");
    return *step_;
  }

 private:
  std::optional<CascadeStep> step_;
};

CurrentCascadeStep& current_cascade_step() {
  static thread_local CurrentCascadeStep current;
  return current;
}

void set_cascade_step(
    const at::Tensor& loc, const at::Tensor& suffix_index, const at::Tensor& q_off, const at::Tensor& k_off,
    int64_t prefix_start,
    int64_t prefix_len, const at::Tensor& prefix_index, int64_t num_heads, double scale, at::TensorList k_bufs,
    at::TensorList v_bufs) {
  TORCH_CHECK(k_bufs.size() == v_bufs.size(), "one V buffer per K buffer");
  current_cascade_step().set(CascadeStep{
      loc, suffix_index, q_off, k_off, prefix_index, prefix_start, prefix_len, num_heads, scale, k_bufs.vec(), v_bufs.vec()});
}

void clear_cascade_step() { current_cascade_step().clear(); }

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer_id) {
  const CurrentCascadeStep& current = current_cascade_step();
  if (!current.is_set()) {
    static const c10::OperatorHandle fallback = c10::Dispatcher::singleton().findSchemaOrThrow("srt_lite::attention", "");
    std::vector<c10::IValue> stack{q, k, v, layer_id};
    fallback.callBoxed(&stack);
    return stack[0].toTensor();
  }
  const CascadeStep& st = current.get();
  TORCH_CHECK(layer_id >= 0 && layer_id < static_cast<int64_t>(st.k_bufs.size()), "no KV buffer for layer ", layer_id);
  const int64_t T = st.loc.size(0);
  at::Tensor out = at::empty({q.size(0), q.size(1)}, q.options());  // rows past T pad the token axis
  if (q.size(0) > T) {
    out.narrow(0, T, q.size(0) - T).zero_();
  }
  cascade_attention(
      q, k, v, st.k_bufs[layer_id], st.v_bufs[layer_id], st.loc, st.suffix_index, st.q_off, st.k_off, st.prefix_start,
      st.prefix_len, st.prefix_index, st.num_heads, st.scale, out);
  return out;
}

}  // namespace

void srt_lite_ops::cascade_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_buf, at::Tensor v_buf,
    const at::Tensor& loc, const at::Tensor& suffix_index, const at::Tensor& q_off, const at::Tensor& k_off,
    int64_t prefix_start, int64_t prefix_len, const at::Tensor& prefix_index, int64_t num_heads, double scale,
    at::Tensor out) {
  ::cascade_attention(q, k, v, std::move(k_buf), std::move(v_buf), loc, suffix_index, q_off, k_off, prefix_start,
                      prefix_len, prefix_index, num_heads, scale, std::move(out));
}

TORCH_LIBRARY(srt_lite_cpu, m) {
  m.def(
      "set_cascade_step(Tensor loc, Tensor suffix_index, Tensor q_off, Tensor k_off, int prefix_start, int prefix_len, "
      "Tensor prefix_index, int num_heads, float scale, Tensor[] k_bufs, Tensor[] v_bufs) -> ()");
  m.def("clear_cascade_step() -> ()");
  m.def("attention(Tensor q, Tensor k, Tensor v, int layer_id) -> Tensor");
  m.def(
      "cascade_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc, "
      "Tensor suffix_index, Tensor q_off, Tensor k_off, int prefix_start, int prefix_len, Tensor prefix_index, int num_heads, "
      "float scale, Tensor(c!) out) -> ()");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) {
  m.impl("cascade_attention", &cascade_attention);
  m.impl("set_cascade_step", &set_cascade_step);
  m.impl("attention", &attention);
}

// Takes no tensor that picks a backend by device.
TORCH_LIBRARY_IMPL(srt_lite_cpu, CompositeExplicitAutograd, m) {
  m.impl("clear_cascade_step", &clear_cascade_step);
}
