// The gated MLP's activation in one pass: for the fused gate_up projection's output
// [T, 2 I] (gate, then up), silu(gate) * up -> [T, I], where torch reads and writes the
// rows three times (a chunk view, silu into a new tensor, a multiply into another).
//
//   silu(g) = g / (1 + exp(-g))
//
// exp is exp_approx.h's polynomial, so the loop vectorizes. Within a few float32 ulps of
// torch's silu * up; in bf16 and fp16 the activation and the product are each rounded to the
// dtype, as torch's two ops round them.
#include "exp_approx.h"
#include "tensor.h"

#include <algorithm>

namespace {

template <typename T>
void silu_mul_rows(const T* x, int64_t stride, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* __restrict gate = x + r * stride;
      const T* __restrict up = gate + inter;
      T* __restrict o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T act = static_cast<T>(g / (1.f + rtp::exp_approx(-g)));  // torch's silu rounding
        o[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

// gate_up [T, 2 I] (rows contiguous, or rows of a wider tensor) -> silu(gate) * up [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2 I]");
  if (gate_up.stride(1) != 1) gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), gate_up.stride(0),
                            out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}
