// The FMA issue limit of this CPU, measured rather than looked up: every thread runs twelve
// independent chains of 8-lane FMAs held in registers (no memory traffic, more chains than
// pipes x latency), so the rate is the FMA pipes' alone. No GEMM can exceed it; the benches
// print GEMM rates as fractions of it and of the best large GEMM (bench/gemm.py).
#include "tensor.h"
#include "vec.h"

#include <chrono>

double fma_peak_gflops(int64_t iters) {
#ifdef RTP_AVX2
  const int64_t threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
      __m256 c0 = _mm256_set1_ps(1.f), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
      __m256 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
      for (int64_t i = 0; i < iters; ++i) {
        c0 = _mm256_fmadd_ps(c0, a, b), c1 = _mm256_fmadd_ps(c1, a, b);
        c2 = _mm256_fmadd_ps(c2, a, b), c3 = _mm256_fmadd_ps(c3, a, b);
        c4 = _mm256_fmadd_ps(c4, a, b), c5 = _mm256_fmadd_ps(c5, a, b);
        c6 = _mm256_fmadd_ps(c6, a, b), c7 = _mm256_fmadd_ps(c7, a, b);
        c8 = _mm256_fmadd_ps(c8, a, b), c9 = _mm256_fmadd_ps(c9, a, b);
        c10 = _mm256_fmadd_ps(c10, a, b), c11 = _mm256_fmadd_ps(c11, a, b);
        // Keep the chains live without a store per iteration.
        asm volatile("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4), "+x"(c5));
        asm volatile("" : "+x"(c6), "+x"(c7), "+x"(c8), "+x"(c9), "+x"(c10), "+x"(c11));
      }
      alignas(32) float sink[8];
      _mm256_store_ps(sink, _mm256_add_ps(_mm256_add_ps(c0, c6), _mm256_add_ps(c5, c11)));
      asm volatile("" : : "r"(sink) : "memory");
    }
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(threads) * iters * 12 * 8 * 2 / s / 1e9;
#else
  TORCH_CHECK(false, "fma_peak_gflops needs AVX2 and FMA");
#endif
}
