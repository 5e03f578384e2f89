// The vector helpers the GEMM kernels share: weights of any storage (float32, bf16, fp16,
// int8) widened to float32 lanes as they are loaded, their scalar equivalents, and VecF, the
// widest float32 register of the build (AVX-512: 16 lanes; AVX2: 8) with its operations, so
// that one kernel source serves both builds (kernels/cpu_build.py).
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
#if defined(RTP_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RTP_AVX512 1
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
// Asks for the cache line holding p in L2 (a T1 hint), for weights read further on. On an
// EPYC Zen 4 the GEMMs' weight streams prefetched kilobytes ahead into L2 ran 1.1-1.6x as
// fast at 1-8 rows of x (bf16 rows at 2: twice) as left to the hardware prefetchers or
// prefetched into L1 (rows_gemm.cpp, packed_gemm.cpp, int8_gemm.cpp; bench/kernel_ab.py).
// Never faults, wherever p points.
template <typename T>
RTP_INLINE void prefetch_l2(const T* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

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

RTP_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(RTP_AVX512)
using VecF = __m512;
constexpr int64_t kLanes = 16;
RTP_INLINE VecF vload(const float* p) { return _mm512_loadu_ps(p); }
RTP_INLINE void vstore(float* p, VecF v) { _mm512_storeu_ps(p, v); }
RTP_INLINE VecF vset1(const float* p) { return _mm512_set1_ps(*p); }
RTP_INLINE VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
RTP_INLINE VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
RTP_INLINE VecF vzero() { return _mm512_setzero_ps(); }
RTP_INLINE float vsum(VecF v) { return _mm512_reduce_add_ps(v); }
RTP_INLINE VecF vloadw(const float* p) { return _mm512_loadu_ps(p); }
RTP_INLINE VecF vloadw(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
RTP_INLINE VecF vloadw(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
RTP_INLINE VecF vloadw(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
RTP_INLINE VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
// Lane i: the sum of v[i]'s lanes. The 16 vectors reduce together in a transposing tree (45
// instructions in all, where 16 horizontal sums take about 8 each).
RTP_INLINE VecF vsum_each(const VecF* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a, b, c, d], that lane's part
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], kEven),
                                  _mm512_shuffle_f32x4(y[0], y[1], kOdd));
  const __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], kEven),
                                  _mm512_shuffle_f32x4(y[2], y[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, kEven), _mm512_shuffle_f32x4(s0, s1, kOdd));
}
#elif defined(RTP_AVX2)
using VecF = __m256;
constexpr int64_t kLanes = 8;
RTP_INLINE VecF vload(const float* p) { return _mm256_loadu_ps(p); }
RTP_INLINE void vstore(float* p, VecF v) { _mm256_storeu_ps(p, v); }
RTP_INLINE VecF vset1(const float* p) { return _mm256_broadcast_ss(p); }
RTP_INLINE VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
RTP_INLINE VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
RTP_INLINE VecF vzero() { return _mm256_setzero_ps(); }
RTP_INLINE float vsum(VecF v) { return hsum(v); }
template <typename w_t>
RTP_INLINE VecF vloadw(const w_t* p) { return load8(p); }
RTP_INLINE VecF vmul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
// Lane i: the sum of v[i]'s lanes (8 vectors reduced together in a transposing tree).
RTP_INLINE VecF vsum_each(const VecF* v) {
  __m256 x[4];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m256 y[2];
  for (int i = 0; i < 2; ++i) {  // per 128-bit lane: [a, b, c, d], that lane's part
    const __m256d a = _mm256_castps_pd(x[2 * i]), b = _mm256_castps_pd(x[2 * i + 1]);
    y[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20),
                       _mm256_permute2f128_ps(y[0], y[1], 0x31));
}
#endif

}  // namespace rtp
