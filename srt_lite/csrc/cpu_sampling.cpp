// The sampler's per-row work on CPU, one call a step instead of a dozen torch ops.
// - argmax_rows, the greedy pick: each row's first maximum, as torch.argmax returns it.
//   torch.argmax over a vocabulary-wide row is a scalar loop; this is one vectorised pass over
//   the row plus a scan of one block.
// - sample_rows: temperature, min-p, top-k and top-p, then one draw. The torch path draws a
//   noise value for every candidate token (an exponential race) and sorts the top 1024
//   probabilities; here one uniform per row picks by the inverse of the kept tokens'
//   cumulative mass, and only the tokens near the top are sorted (docs/development.md has
//   the timings).
// Built with the other csrc files into one extension by srt_lite/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
constexpr int64_t kBlock = 16 * kW;  // logits a block: its maximum is one vector reduction

// The maximum of x[0, n), NaN if any is NaN (at::vec::maximum propagates NaN).
float block_max(const float* x, int64_t n) {
  int64_t i = 0;
  Vec m(-std::numeric_limits<float>::infinity());
  for (; i + kW <= n; i += kW) m = at::vec::maximum(m, Vec::loadu(x + i));
  float out = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
  for (; i < n; ++i) out = std::isnan(x[i]) || x[i] > out ? x[i] : out;
  return out;
}

// The first index of row x[0, n)'s maximum; a NaN counts as larger than any number, so the
// first NaN wins, as in torch.argmax. A block whose maximum only ties the best one so far
// does not replace it, which keeps the first of equal maxima.
int64_t argmax_row(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_block = 0;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const float m = block_max(x + b0, std::min(kBlock, n - b0));
    if (std::isnan(m)) {
      best = m;
      best_block = b0;
      break;  // no later block comes before this one's first NaN
    }
    if (m > best) {
      best = m;
      best_block = b0;
    }
  }
  const int64_t end = std::min(n, best_block + kBlock);
  for (int64_t i = best_block; i < end; ++i) {
    if (x[i] == best || (std::isnan(best) && std::isnan(x[i]))) return i;
  }
  return best_block;  // every logit is -inf: the first one, as torch.argmax
}

// logits [B, V] fp32 with contiguous rows -> [B] int64, each row's first maximum.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "argmax_rows: logits must be fp32 [B, V] with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: an empty row has no maximum");
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));  // [B]
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  int64_t* ids = out.data_ptr<int64_t>();
  // A row of a large vocabulary is worth a thread of its own: rows go to threads one by one.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = argmax_row(x + r * stride, V);
  });
  return out;
}

// What one row keeps and draws from (SamplingParams' meaning of each field).
struct RowParams {
  float temperature;  // > 0
  int64_t top_k;      // >= V: off
  float top_p;        // >= 1: off
  float min_p;        // <= 0: off
  double u;           // the row's uniform draw in [0, 1)
};

// e[0, V) = exp((x - max) / temperature), zero below min_p (relative to the top token's 1);
// block[b] = the sum of block b's kBlock values. Returns the row's whole mass.
double weights(const float* x, int64_t V, const RowParams& p, float* e, std::vector<double>& block) {
  const float top = block_max(x, V), scale = 1.f / p.temperature, fl = p.min_p > 0.f ? p.min_p : 0.f;
  const Vec shift(top), inv(scale), floor(fl), zero(0.f);
  block.assign((V + kBlock - 1) / kBlock, 0.0);
  double total = 0.0;
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const int64_t n = std::min(kBlock, V - b0);
    Vec acc(0.f);
    int64_t i = 0;
    for (; i + kW <= n; i += kW) {
      Vec v = ((Vec::loadu(x + b0 + i) - shift) * inv).exp();
      v = Vec::blendv(zero, v, v >= floor);  // min-p: below the floor, none of the mass
      v.store(e + b0 + i);
      acc = acc + v;
    }
    double sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
    for (; i < n; ++i) {
      const float v = std::exp((x[b0 + i] - top) * scale);
      e[b0 + i] = v >= fl ? v : 0.f;
      sum += e[b0 + i];
    }
    block[b0 / kBlock] = sum;
    total += sum;
  }
  return total;
}

// The first token whose cumulative mass passes target, walking the blocks' sums, then the
// block; rounding cannot push it past the last token with any mass.
int64_t draw_in_row(const float* e, int64_t V, const std::vector<double>& block, double target) {
  int64_t b = 0, last = -1;
  for (; b + 1 < static_cast<int64_t>(block.size()) && target >= block[b]; ++b) target -= block[b];
  for (int64_t i = b * kBlock; i < std::min(V, (b + 1) * kBlock); ++i) {
    if (e[i] <= 0.f) continue;
    last = i;
    target -= e[i];
    if (target < 0.0) return i;
  }
  for (int64_t i = std::min(V, (b + 1) * kBlock) - 1; last < 0 && i >= 0; --i) last = e[i] > 0.f ? i : last;
  return last;
}

// The top-k / top-p set of a row, most likely first (ties by index), or empty when neither
// filter is on. Tokens are gathered above a threshold that falls until the set is decided
// within them: every token left out is below every one gathered, so the order of the first
// gathered tokens is the order of the whole row's.
std::vector<std::pair<float, int64_t>> nucleus(const float* e, int64_t V, const RowParams& p, double total) {
  std::vector<std::pair<float, int64_t>> c;
  const bool by_k = p.top_k < V, by_p = p.top_p < 1.f;
  if (!by_k && !by_p) return c;
  for (float floor : {0x1p-10f, 0x1p-24f, 0x1p-60f, 0.f}) {
    c.clear();
    const Vec least(floor);
    int64_t i = 0;
    for (; i + kW <= V; i += kW) {  // a vector compare skips the (many) vectors with none above
      if ((Vec::loadu(e + i) >= least).zero_mask() == (1 << kW) - 1) continue;
      for (int64_t j = i; j < i + kW; ++j) {
        if (e[j] > 0.f && e[j] >= floor) c.emplace_back(e[j], j);
      }
    }
    for (; i < V; ++i) {
      if (e[i] > 0.f && e[i] >= floor) c.emplace_back(e[i], i);
    }
    if (by_k && static_cast<int64_t>(c.size()) < p.top_k && floor > 0.f) continue;
    std::sort(c.begin(), c.end(), [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    const size_t k = by_k ? std::min<size_t>(c.size(), p.top_k) : c.size();
    double mass = total;  // top-p is a share of what top-k keeps (of the whole row without it)
    if (by_k) {
      mass = 0.0;
      for (size_t j = 0; j < k; ++j) mass += c[j].first;
    }
    size_t keep = k;
    if (by_p) {
      double before = 0.0;
      for (keep = 0; keep < k && (keep == 0 || before <= p.top_p * mass); ++keep) before += c[keep].first;
      if (!by_k && before <= p.top_p * mass && floor > 0.f) continue;  // the nucleus reaches below the floor
    }
    c.resize(keep);
    return c;
  }
  return c;
}

// One row's pick: the kept tokens' weights, then the token where u of their mass falls.
int64_t sample_row(const float* x, int64_t V, const RowParams& p, std::vector<float>& e, std::vector<double>& block) {
  e.resize(V);
  const double total = weights(x, V, p, e.data(), block);
  if (!(total > 0.0) || !std::isfinite(total)) return argmax_row(x, V);  // no usable mass (NaN or inf logits)
  const auto kept = nucleus(e.data(), V, p, total);
  if (kept.empty()) return draw_in_row(e.data(), V, block, p.u * total);
  double mass = 0.0;
  for (const auto& [w, i] : kept) mass += w;
  double target = p.u * mass;
  for (const auto& [w, i] : kept) {
    target -= w;
    if (target < 0.0) return i;
  }
  return kept.back().second;
}

// logits [R, V] fp32 (rows contiguous); per row temperature [R] (> 0), top_k [R] int64 (>= V
// off), top_p [R], min_p [R] and a uniform u [R] in [0, 1) -> [R] int64 token ids.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "sample_rows: logits must be fp32 [R, V] with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "sample_rows: an empty row has nothing to sample");
  const auto f32 = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.numel() == R, "sample_rows: ", name, " needs one value per row");
    return t.to(at::kFloat).contiguous();
  };
  const at::Tensor temp = f32(temperature, "temperature"), tp = f32(top_p, "top_p"), mp = f32(min_p, "min_p");
  const at::Tensor uu = u.to(at::kDouble).contiguous();
  TORCH_CHECK(top_k.numel() == R, "sample_rows: top_k needs one value per row");
  TORCH_CHECK(R == 0 || temp.min().item<float>() > 0.f, "sample_rows: temperature must be positive");
  const at::Tensor tk = top_k.to(at::kLong).contiguous();
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));  // [R]
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> e;        // [V] a row's weights, kept between calls
    thread_local std::vector<double> block;  // [V / kBlock] their block sums
    for (int64_t r = begin; r < end; ++r) {
      const RowParams p{temp.data_ptr<float>()[r], tk.data_ptr<int64_t>()[r], tp.data_ptr<float>()[r],
                        mp.data_ptr<float>()[r], uu.data_ptr<double>()[r]};
      out.data_ptr<int64_t>()[r] = sample_row(x + r * stride, V, p, e, block);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("sample_rows", &sample_rows);
}
