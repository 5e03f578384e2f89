// x @ w (+ bias) (+ residual) for a few rows of x, as decode runs it on a CPU.
//
// With one or a few tokens a step, a projection is a matrix-vector product: it is bound by
// how fast the weights stream from memory, not by arithmetic. This kernel reads w [K, N]
// (row-major, the engine's [in, out] layout) exactly once: each thread streams a contiguous
// run of rows into its own accumulators (N floats per row of x, in L1/L2).
#include "tensor.h"

#include <algorithm>
#include <vector>

torch::Tensor small_gemm(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                         c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(0), "x [M, K] @ w [K, N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(1);
  auto out = residual.has_value() ? residual->contiguous().clone() : torch::zeros({M, N}, x.options());
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "residual must be [M, N]");
  if (bias.has_value()) out.add_(bias->view({1, N}));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();

  // Each thread streams a contiguous run of w's rows (purely sequential reads, which the
  // prefetchers like best) into its own partial sums; the partials are added at the end.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), K / 64));
  std::vector<float> partial(parts * M * N, 0.f);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t part = p0; part < p1; ++part) {
      const int64_t k0 = K * part / parts, k1 = K * (part + 1) / parts;
      float* acc = partial.data() + part * M * N;
      int64_t k = k0;
      // Four rows of w per pass over the accumulators: a quarter of the L1 traffic.
      for (; k + 4 <= k1; k += 4) {
        const float* __restrict w0 = wp + k * N;
        const float* __restrict w1 = w0 + N;
        const float* __restrict w2 = w1 + N;
        const float* __restrict w3 = w2 + N;
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = xp + m * K + k;
          const float x0 = xm[0], x1 = xm[1], x2 = xm[2], x3 = xm[3];
          float* __restrict a = acc + m * N;
#pragma omp simd
          for (int64_t j = 0; j < N; ++j) a[j] += x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j];
        }
      }
      for (; k < k1; ++k) {
        const float* __restrict wr = wp + k * N;
        for (int64_t m = 0; m < M; ++m) {
          const float xv = xp[m * K + k];
          float* __restrict a = acc + m * N;
#pragma omp simd
          for (int64_t j = 0; j < N; ++j) a[j] += xv * wr[j];
        }
      }
    }
  });
  for (int64_t part = 0; part < parts; ++part) {
    const float* __restrict acc = partial.data() + part * M * N;
#pragma omp simd
    for (int64_t i = 0; i < M * N; ++i) op[i] += acc[i];
  }
  return out;
}
