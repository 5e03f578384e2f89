// RMSNorm in one pass over each row, with HF's rounding for every dtype.
//
// torch's rms_norm composes several ops (pow, mean, rsqrt, two multiplies): at decode sizes
// (one 768-wide row) that is ~30 us of dispatch per call, 25 calls a step. This computes
//   float32:    y = x * rsqrt(mean(x^2) + eps) * w
//   bf16/fp16:  y = w * round(x * rsqrt(mean(x^2) + eps))   (statistics in float32)
// the latter exactly as HF's LlamaRMSNorm does (normalise in float32, cast, then scale in
// the model dtype); rows are split over threads only when there are enough of them.
#include "tensor.h"

#include <cmath>

namespace {

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* __restrict xr = x + r * H;
      T* __restrict yr = y + r * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) {
        const float v = static_cast<float>(xr[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) yr[i] = xr[i] * inv * w[i];
      } else {
        for (int64_t i = 0; i < H; ++i) {
          const T normed = static_cast<T>(static_cast<float>(xr[i]) * inv);  // HF's cast
          yr[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
        }
      }
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), "x [..., H], w [H]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w must share a dtype");
  x = x.contiguous();
  w = w.contiguous();
  auto y = torch::empty_like(x);
  const int64_t H = w.size(0), rows = x.numel() / std::max<int64_t>(H, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                       rows, H, static_cast<float>(eps));
  });
  return y;
}
