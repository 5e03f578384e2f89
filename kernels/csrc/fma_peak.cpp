// The FMA issue limit of this CPU, measured rather than looked up: every thread runs twelve
// independent chains of FMAs on the build's widest registers (AVX2: 8 lanes; AVX-512: 16) (no memory traffic, more chains than
// pipes x latency), so the rate is the FMA pipes' alone. No GEMM can exceed it; the benches
// print GEMM rates as fractions of it and of the best large GEMM (bench/gemm.py).
#include "tensor.h"
#include "vec.h"

#include <chrono>

int64_t vector_lanes() {
#ifdef RTP_AVX2
  return rtp::kLanes;
#else
  return 1;
#endif
}

double fma_peak_gflops(int64_t iters) {
#ifdef RTP_AVX2
  using rtp::VecF;
  using rtp::vfma;
  const int64_t threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float av = 0.999999f, bv = 1e-7f, one = 1.f;
      const VecF a = rtp::vset1(&av), b = rtp::vset1(&bv);
      VecF c0 = rtp::vset1(&one), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
      VecF c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
      for (int64_t i = 0; i < iters; ++i) {
        c0 = vfma(c0, a, b), c1 = vfma(c1, a, b);
        c2 = vfma(c2, a, b), c3 = vfma(c3, a, b);
        c4 = vfma(c4, a, b), c5 = vfma(c5, a, b);
        c6 = vfma(c6, a, b), c7 = vfma(c7, a, b);
        c8 = vfma(c8, a, b), c9 = vfma(c9, a, b);
        c10 = vfma(c10, a, b), c11 = vfma(c11, a, b);
        // Keep the chains live without a store per iteration.
        asm volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5));
        asm volatile("" : "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11));
      }
      alignas(64) float sink[rtp::kLanes];
      rtp::vstore(sink, rtp::vadd(rtp::vadd(c0, c6), rtp::vadd(c5, c11)));
      asm volatile("" : : "r"(sink) : "memory");
    }
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(threads) * iters * 12 * rtp::kLanes * 2 / s / 1e9;
#else
  TORCH_CHECK(false, "fma_peak_gflops needs AVX2 and FMA");
#endif
}
