// The widening loads the GEMM kernels share: eight weights of any storage (float32, bf16,
// fp16, int8) as eight float32 lanes of an AVX2 register, and their scalar equivalents.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

// The vector helpers must inline into the loops: an out-of-line call per FMA, which GCC's
// inlining budget chose for a file with many instantiations, ran at half the speed.
#define RTP_INLINE inline __attribute__((always_inline))

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RTP_AVX2 1
#endif

namespace rtp {

inline float widen(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(float v) { return v; }

#ifdef RTP_AVX2
RTP_INLINE __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
RTP_INLINE __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
RTP_INLINE __m256 load8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
RTP_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#endif

}  // namespace rtp
