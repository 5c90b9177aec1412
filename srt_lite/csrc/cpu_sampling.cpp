// The greedy pick of the sampler on CPU: each row's first maximum, as torch.argmax returns it.
// torch.argmax over a vocabulary-wide row is a scalar loop (~0.1 ms for 128K logits) and the
// blocked torch version in srt_lite/sampling/sampler.py takes five ops; this is one pass over
// the row plus a scan of one block, a few tens of microseconds a step at one row.
// Built with the other csrc files into one extension by srt_lite/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

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
  // One row of a large vocabulary takes tens of microseconds: rows go to threads one by one.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = argmax_row(x + r * stride, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
