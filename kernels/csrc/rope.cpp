// Rotary embedding in the rotate-half layout HF uses (engine/models/llama.py: apply_rope), in
// one pass over q and k instead of torch's five (neg, cat, two multiplies, an add, each a new
// tensor):
//
//   out[..., :D/2] = x1 * cos1 - x2 * sin1      x1 = x[..., :D/2], x2 = x[..., D/2:]
//   out[..., D/2:] = x2 * cos2 + x1 * sin2
//
// Each product and the sum are rounded to x's dtype, as the torch ops round them, so the
// result is the reference's bit for bit in float32 and bf16 (no FMA contraction here: it
// would skip the products' rounding).
#include "tensor.h"

#include <algorithm>

#pragma GCC optimize("fp-contract=off")

namespace {

template <typename T>
void rope_rows(const T* x, int64_t stride_t, int64_t stride_h, const T* cos, const T* sin,
               T* out, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / std::max<int64_t>(heads * dim, 1)),
                   [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* __restrict c = cos + t * dim;
      const T* __restrict s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* __restrict xr = x + t * stride_t + h * stride_h;
        T* __restrict o = out + (t * heads + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const T x1 = xr[i], x2 = xr[i + half];
          const T a = static_cast<T>(static_cast<float>(x1) * static_cast<float>(c[i]));
          const T b = static_cast<T>(static_cast<float>(x2) * static_cast<float>(s[i]));
          o[i] = static_cast<T>(static_cast<float>(a) - static_cast<float>(b));
          const T a2 = static_cast<T>(static_cast<float>(x2) * static_cast<float>(c[i + half]));
          const T b2 = static_cast<T>(static_cast<float>(x1) * static_cast<float>(s[i + half]));
          o[i + half] = static_cast<T>(static_cast<float>(a2) + static_cast<float>(b2));
        }
      }
    }
  });
}

}  // namespace

// x [T, H, D] (its last dim contiguous: q and k as views of the fused qkv projection),
// cos and sin [T, 1, D] or [T, D] in x's dtype; returns [T, H, D] contiguous.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x must be [T, H, D] with D even");
  TORCH_CHECK(x.stride(2) == 1, "x's head dim must be contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must be in x's dtype");
  TORCH_CHECK(cos.numel() == tokens * dim && sin.numel() == tokens * dim,
              "cos and sin must be [T, 1, D]");
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto out = at::empty({tokens, heads, dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1),
                        cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), tokens, heads, dim);
  });
  return out;
}
