// How fast the packed GGUF products stream a weight from memory, against a plain vector sum of
// the same bytes: the kernel source is compiled in, so a variant of it can be timed without
// rebuilding the extension. Each repetition times the sum, then the product, over a rotating
// set of copies far larger than the last-level cache; the reported ratio is the median of the
// per-repetition ratios, which cancels most of a shared host's drift.
//
//   TORCH=$(.venv/bin/python -c "import torch, os; print(os.path.dirname(torch.__file__))")
//   g++ -O3 -std=c++20 -ffp-contract=off -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512dq \
//       -mfma -mf16c -DCPU_CAPABILITY=AVX512 -DCPU_CAPABILITY_AVX512 \
//       -I$TORCH/include \
//       -I$TORCH/include/torch/csrc/api/include benchmarks/csrc/gguf_stream.cpp -o /tmp/gguf_stream \
//       -L$TORCH/lib -ltorch_cpu -lc10 -Wl,-rpath,$TORCH/lib
//   /tmp/gguf_stream TYPE ROWS COLS X_ROWS [COPIES] [THREADS]     # TYPE: 8 Q8_0, 12 Q4_K, 14 Q6_K
//
// For AVX2: -mavx2 -mfma -mf16c -DCPU_CAPABILITY=AVX2 -DCPU_CAPABILITY_AVX2 instead. To time a
// variant, copy the kernel source and add -DKERNEL_SRC='"/path/to/the/copy.cpp"'.
#ifndef KERNEL_SRC
#define KERNEL_SRC "../../srt_lite/csrc/cpu_gguf_linear.cpp"
#endif
#include KERNEL_SRC

#include <chrono>
#include <cstdio>
#include <random>

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Random blocks of `type` with finite fp16 scales (any other bytes are valid codes).
std::vector<uint8_t> random_rows(int64_t type, int64_t N, int64_t K, std::mt19937& rng) {
  const TypeInfo info = type_info(type);
  const int64_t row_bytes = K / info.unit * info.bytes;
  std::vector<uint8_t> raw(N * row_bytes);  // [N, row bytes]
  for (auto& b : raw) b = rng() & 0xFF;
  for (int64_t i = 0; i < N * K / info.unit; ++i) {
    uint8_t* blk = raw.data() + i * info.bytes;
    // Where the block's fp16 scales lie: Q6_K's d at its end, Q4_K / Q5_K's d and dmin first,
    // Q8_0's d first.
    const std::vector<int> halves = type == kQ6_K ? std::vector<int>{208}
                                    : is_k_type(type) ? std::vector<int>{0, 2} : std::vector<int>{0};
    for (int off : halves) {
      const uint16_t h = 0x2000 | (rng() & 0x3FF);  // a small positive half
      std::memcpy(blk + off, &h, 2);
    }
  }
  return raw;
}

// Seconds of one multi-threaded vector sum over `bytes` at p.
double time_sum(const uint8_t* p, int64_t bytes, int threads) {
  const double t0 = now();
  float total = 0.f;
  const int64_t lines = bytes / 256;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < lines; ++i) {
      const float* f = reinterpret_cast<const float*>(p + 256 * i);
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(f)), a1 = _mm256_add_ps(a1, _mm256_loadu_ps(f + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(f + 16)), a3 = _mm256_add_ps(a3, _mm256_loadu_ps(f + 24));
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(f + 32)), a1 = _mm256_add_ps(a1, _mm256_loadu_ps(f + 40));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(f + 48)), a3 = _mm256_add_ps(a3, _mm256_loadu_ps(f + 56));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (float v : lanes) total += v;
  }
  if (total == 12345.f) std::printf(" ");  // keeps the sum
  return now() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s TYPE ROWS COLS X_ROWS [COPIES] [THREADS]\n", argv[0]);
    return 2;
  }
  const int64_t type = std::atoll(argv[1]), N = std::atoll(argv[2]), K = std::atoll(argv[3]), M = std::atoll(argv[4]);
  const int copies = argc > 5 ? std::atoi(argv[5]) : 6, threads = argc > 6 ? std::atoi(argv[6]) : 2;
  gguf_allow_vnni(true);  // the VNNI kernels where this build and CPU have them
  TORCH_CHECK(packs_type(type), "no packed kernel for type ", type, " in this build");
  const TypeInfo info = type_info(type);
  const int64_t row_bytes = K / info.unit * info.bytes, width = K / info.unit * packed_group_bytes(type);
  const int64_t groups = N / kGroup, bytes = groups * width;
  std::mt19937 rng(1);
  const std::vector<uint8_t> raw = random_rows(type, N, K, rng);
  std::vector<at::Tensor> ws;  // the copies, each in its own arena pages as the server holds them
  for (int c = 0; c < copies; ++c) {
    ws.push_back(huge_page_tensor(groups, width));
    for (int64_t g = 0; g < groups; ++g) {
      repack_group(type, raw.data() + g * kGroup * row_bytes, row_bytes, K, ws.back().data_ptr<uint8_t>() + g * width);
    }
  }
  std::vector<float> x(M * K);  // [M, K]
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  QuantizedX xq;
  xq.Kp = K;
  is_k_type(type) ? quantize_x256(x.data(), M, K, xq) : quantize_x32(x.data(), M, K, xq);
  const int64_t run = std::max<int64_t>(1, groups / (8 * threads));  // as dot_linear claims them
  std::vector<double> kernel_gbs, sum_gbs, ratio;
  for (int rep = 0; rep < 31; ++rep) {
    double ts = 0;
    for (const at::Tensor& w : ws) ts += time_sum(w.data_ptr<uint8_t>(), bytes, threads);
    const double t0 = now();
    for (const at::Tensor& w : ws) {
      std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
      {
        std::vector<float> sums(M * kGroup);  // [M, 16]
        for (int64_t b = next.fetch_add(run); b < groups; b = next.fetch_add(run)) {
          for (int64_t g = b; g < std::min(groups, b + run); ++g) {
            packed_rows(type, w.data_ptr<uint8_t>() + g * width, K, xq, M, sums.data(), kGroup);
          }
        }
      }
    }
    const double tk = now() - t0;
    kernel_gbs.push_back(bytes * copies / tk / 1e9);
    sum_gbs.push_back(bytes * copies / ts / 1e9);
    ratio.push_back(ts / tk);
  }
  std::printf("type %ld, %ld x %ld, %ld rows of x, %d threads: product %.1f GB/s, sum %.1f GB/s, ratio %.3f\n", type, N,
              K, M, threads, median(kernel_gbs), median(sum_gbs), median(ratio));
  return 0;
}
