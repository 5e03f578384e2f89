// exp(x) for float32, written so that loops over it vectorize: 2^(x log2 e) as 2^floor
// times a degree-6 polynomial of the fraction (relative error 1e-7, float32's own rounding),
// x clamped to [-87, 88] (below, 2^-126 and smaller flush to a denormal-free tiny number;
// above, float32 overflows). paged_prefill's softmax and silu_mul's sigmoid use it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace rtp {

inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * 1.44269504088896341f;
  const float whole = std::floor(t);
  const float f = t - whole;
  float p = 2.1877505e-4f;
  p = p * f + 1.2387822e-3f;
  p = p * f + 9.6845804e-3f;
  p = p * f + 5.5480428e-2f;
  p = p * f + 2.4023050e-1f;
  p = p * f + 6.9314694e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float two_to_whole;
  std::memcpy(&two_to_whole, &bits, sizeof bits);
  return p * two_to_whole;
}

}  // namespace rtp
