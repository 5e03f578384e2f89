// x @ w.T (* scale) (+ bias) (+ residual) for a few rows of x, over float32, bf16/fp16 or int8
// weights stored [out, in] (the checkpoint's layout, so a float32 weight is used where the
// loader mapped it, never transposed).
//
// At decode batch sizes a projection is bound by how fast its weights stream from memory, so
// a weight stored in 2 (bf16) or 1 (int8) bytes is 2x or 4x less to read than float32. This
// kernel reads each weight once: a thread takes a contiguous run of output rows, widens a
// few of them to float32 in a buffer that stays in L1, and dots every row of x (float32,
// kept in L1/L2) against them. Accumulation is float32 whatever the storage; int8 weights are
// symmetric per output channel (w = q * scale[n]), so the scale is applied once per output.
// The loops are plain C++ that the compiler vectorises for the CPU it is built on
// (-march=native: AVX2, AVX-512 ...), so every ISA runs the same, tested source.
//
// With more than one row of x (and for float32 weights always), the rows are taken in groups
// against blocks of weight rows held in vector registers (AVX-512 or AVX2), widened as they
// are loaded: each weight row is read from memory once and from L1 once per group of rows,
// with no buffer in between. A single row of x against float32 weights takes eight weight
// rows at a time, more rows four.
#include "gemm_args.h"
#include "parallel.h"
#include "tensor.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRows = 4;  // weight rows widened and dotted together

// Each block of weight rows streams from memory once. While one block is read, the same
// offset of the next block is prefetched into L2 (a T1 hint, 6-24 KiB ahead). Left to the
// hardware prefetchers, the 4 or 8 row streams of a block (a new 4 KiB page every 3 KiB of
// a 768-wide row) ran 1.3-1.6x slower on an EPYC Zen 4 at 1-8 rows of x (float32; bf16 at
// 2-8 rows: 1.6-2x; bench/kernel_ab.py, llama-100m's shapes streamed from memory).

using rtp::widen;

// Dot products of x row m against kRows weight rows, widened as they are read.
template <typename w_t>
inline void dot_rows_portable(const float* __restrict xm, const w_t* __restrict w0, int64_t K,
                              float* s) {
  const w_t* __restrict w1 = w0 + K;
  const w_t* __restrict w2 = w1 + K;
  const w_t* __restrict w3 = w2 + K;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t k = 0; k < K; ++k) {
    const float xv = xm[k];
    s0 += xv * widen(w0[k]);
    s1 += xv * widen(w1[k]);
    s2 += xv * widen(w2[k]);
    s3 += xv * widen(w3[k]);
  }
  s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
}

#ifdef RTP_AVX2
// The compiler does not vectorise the widening of mixed-type streams well (int8 above all),
// so the memory-bound path is written out for AVX2, which every x86 machine here has.
using rtp::load8;
using rtp::hsum;

// One weight row at a time, so the weights are read as one sequential stream; four
// accumulators hide the FMA latency.
template <typename w_t>
inline float dot_row(const float* __restrict xm, const w_t* __restrict w, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    rtp::prefetch_l2(w + kRows * K + k);  // this row of the next block (see kRows)
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k), load8(w + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 8), load8(w + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 16), load8(w + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 24), load8(w + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k), load8(w + k), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) s += xm[k] * widen(w[k]);
  return s;
}

template <typename w_t>
inline void dot_rows(const float* __restrict xm, const w_t* __restrict w0, int64_t K, float* s) {
  for (int64_t r = 0; r < kRows; ++r) s[r] = dot_row(xm, w0 + r * K, K);
}
#else
template <typename w_t>
inline void dot_rows(const float* __restrict xm, const w_t* __restrict w0, int64_t K, float* s) {
  dot_rows_portable(xm, w0, K, s);
}
#endif

// The same for two rows of x at once against already widened weights: 6 loads per 8 FMAs.
inline void dot_rows2(const float* __restrict xa, const float* __restrict xb,
                      const float* __restrict w0, int64_t K, float* sa, float* sb) {
  const float* __restrict w1 = w0 + K;
  const float* __restrict w2 = w1 + K;
  const float* __restrict w3 = w2 + K;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f, b0 = 0.f, b1 = 0.f, b2 = 0.f, b3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
  for (int64_t k = 0; k < K; ++k) {
    const float xv = xa[k], yv = xb[k];
    const float v0 = w0[k], v1 = w1[k], v2 = w2[k], v3 = w3[k];
    a0 += xv * v0, a1 += xv * v1, a2 += xv * v2, a3 += xv * v3;
    b0 += yv * v0, b1 += yv * v1, b2 += yv * v2, b3 += yv * v3;
  }
  sa[0] = a0, sa[1] = a1, sa[2] = a2, sa[3] = a3;
  sb[0] = b0, sb[1] = b1, sb[2] = b2, sb[3] = b3;
}

#if defined(RTP_AVX512)
constexpr int kGroup = 4;  // rows of x per pass: 16 accumulators of the 32 registers
#elif defined(RTP_AVX2)
constexpr int kGroup = 2;  // 8 accumulators of the 16 registers
#endif
#ifdef RTP_AVX2
using rtp::kLanes;
using rtp::vfma;
using rtp::VecF;
using rtp::vload;
using rtp::vloadw;
using rtp::vsum;
using rtp::vzero;
#endif

#ifdef RTP_AVX2
#define RTP_F32_ROWS 1
// G rows of x (row stride K) against R consecutive weight rows (any storage, widened as
// loaded), one accumulator each: s[g * R + r]. A single row of x takes eight float32 weight
// rows at a time (eight streams keep more loads in flight: bench/linear.py), more rows
// four, so the accumulators fit the registers.
template <int R, int G, typename w_t>
RTP_INLINE void f32_block(const float* __restrict x, const w_t* __restrict w, int64_t K, float* s) {
  VecF acc[G][R];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    VecF wv[R];
    for (int r = 0; r < R; ++r) {
      rtp::prefetch_l2(w + (R + r) * K + k);  // the next block's row (see kRows)
      wv[r] = vloadw(w + r * K + k);
    }
    for (int g = 0; g < G; ++g) {
      const VecF xv = vload(x + g * K + k);
      for (int r = 0; r < R; ++r) acc[g][r] = vfma(xv, wv[r], acc[g][r]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) {
      float v = vsum(acc[g][r]);
      for (int64_t j = k; j < K; ++j) v += x[g * K + j] * widen(w[r * K + j]);
      s[g * R + r] = v;
    }
}

// The two entries to the blocks are kept out of line: inlined into the threads' loop, the
// one-row block compiled to code 12% slower (measured, bench/linear.py).
#define RTP_NOINLINE __attribute__((noinline))

// One row of x against eight weight rows.
RTP_NOINLINE void f32_single(const float* x, const float* w, int64_t K, float* s) {
  f32_block<8, 1>(x, w, K, s);
}

// Rows [m, m + G) of x against kRows weight rows; G < kGroup only for the last rows.
template <typename w_t>
RTP_NOINLINE void f32_rows_of_x(const float* x, const w_t* w, int64_t K, int64_t G, float* s) {
  switch (G) {
    case 1: f32_block<kRows, 1>(x, w, K, s); break;
    case 2: f32_block<kRows, 2>(x, w, K, s); break;
#if defined(RTP_AVX512)
    case 3: f32_block<kRows, 3>(x, w, K, s); break;
    case 4: f32_block<kRows, 4>(x, w, K, s); break;
#endif
    default: TORCH_CHECK(false, "rows_gemm: bad row group");
  }
}

// Every row of x against blocks of R weight rows (eight for a single row of x over float32,
// else kRows); threads take contiguous runs of blocks in turn (parallel.h). `scale`: int8's, per output row.
template <int R, typename w_t>
void f32_blocks(const float* x, const w_t* w, const float* scale, const float* bias,
                const float* residual, float* out, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = (N + R - 1) / R;
  rtp::parallel_chunks(blocks, rtp::chunk_for(blocks), [&](rtp::Chunks& chunks) {
    std::vector<w_t> tail;
    float s[kGroup * R];
    for (int64_t b0, b1; chunks.next(b0, b1);) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = blk * R;
        const int64_t rows = std::min<int64_t>(R, N - n0);
        const w_t* wr = w + n0 * K;
        if (rows < R) {  // pad the last, partial block with zero rows
          tail.assign(R * K, w_t(0));
          std::copy(wr, wr + rows * K, tail.begin());
          wr = tail.data();
        }
        for (int64_t m = 0; m < M; m += kGroup) {
          const int64_t G = std::min<int64_t>(kGroup, M - m);
          if constexpr (R == kRows) {
            f32_rows_of_x(x + m * K, wr, K, G, s);
          } else {
            f32_single(x + m * K, wr, K, s);  // M == 1, float32
          }
          for (int64_t g = 0; g < G; ++g)
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t i = (m + g) * N + n0 + r;
              float v = scale ? s[g * R + r] * scale[n0 + r] : s[g * R + r];
              if (bias) v += bias[n0 + r];
              if (residual) v += residual[i];
              out[i] = v;
            }
        }
      }
    }
  });
}
#endif

template <typename w_t>
void rows_kernel(const float* x, const w_t* w, const float* scale, const float* bias,
                 const float* residual, float* out, int64_t M, int64_t K, int64_t N);

// Float32 weights: rows of x in groups of kGroup against each block of weight rows.
void rows_f32(const float* x, const float* w, const float* bias, const float* residual,
              float* out, int64_t M, int64_t K, int64_t N) {
#ifdef RTP_F32_ROWS
  if (M == 1) {  // as f32_single takes them
    f32_blocks<8>(x, w, nullptr, bias, residual, out, M, K, N);
  } else {
    f32_blocks<kRows>(x, w, nullptr, bias, residual, out, M, K, N);
  }
#else
  rows_kernel(x, w, nullptr, bias, residual, out, M, K, N);
#endif
}

template <typename w_t>
void rows_kernel(const float* x, const w_t* w, const float* scale, const float* bias,
                 const float* residual, float* out, int64_t M, int64_t K, int64_t N) {
#ifdef RTP_F32_ROWS
  if (M > 1) {  // rows of x in groups against weight rows widened in registers
    f32_blocks<kRows>(x, w, scale, bias, residual, out, M, K, N);
    return;
  }
#endif
  const int64_t full = N / kRows;  // blocks of kRows weight rows; a ragged tail is padded
  const int64_t blocks = (N + kRows - 1) / kRows;
  auto store = [&](int64_t m, int64_t n0, int64_t rows, const float* sums) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = n0 + r;
      float v = scale ? sums[r] * scale[n] : sums[r];
      if (bias) v += bias[n];
      if (residual) v += residual[m * N + n];
      out[m * N + n] = v;
    }
  };
  // Contiguous runs of output rows, taken in turn: sequential weight reads.
  rtp::parallel_chunks(blocks, rtp::chunk_for(blocks), [&](rtp::Chunks& chunks) {
    std::vector<float> wbuf(kRows * K);
    std::vector<w_t> tail;
    float sa[kRows], sb[kRows];
    for (int64_t b0, b1; chunks.next(b0, b1);) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = blk * kRows;
        const int64_t rows = std::min(kRows, N - n0);
        const w_t* wr = w + n0 * K;
        if (blk >= full) {  // pad the last, partial block with zero rows
          tail.assign(kRows * K, w_t(0));
          std::copy(wr, wr + rows * K, tail.begin());
          wr = tail.data();
        }
        if (M <= 2) {  // memory-bound: widen as we read, nothing else reuses the weights
          for (int64_t m = 0; m < M; ++m) {
            dot_rows(x + m * K, wr, K, sa);
            store(m, n0, rows, sa);
          }
          continue;
        }
        float* __restrict dst = wbuf.data();
  #pragma omp simd
        for (int64_t i = 0; i < kRows * K; ++i) dst[i] = widen(wr[i]);
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
          dot_rows2(x + m * K, x + (m + 1) * K, dst, K, sa, sb);
          store(m, n0, rows, sa);
          store(m + 1, n0, rows, sb);
        }
        if (m < M) {
          dot_rows(x + m * K, dst, K, sa);
          store(m, n0, rows, sa);
        }
      }
    }
  });
}

}  // namespace

// x [M, K] (any float dtype), w [N, K] bf16 / fp16 / int8 / fp32, scale [N] float32 (int8 only),
// bias [N] and residual [M, N] optional; returns [M, N] in x's dtype.
torch::Tensor rows_gemm(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale,
                        c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] @ w [N, K].T");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous [N, K]");
  const bool int8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == scale.has_value(), "int8 weights need a scale, other dtypes none");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto args = gemm_args(x, N, scale, bias, residual);
  const float* sp = ptr_or_null(args.scale);
  const float* bp = ptr_or_null(args.bias);
  const float* rp = ptr_or_null(args.residual);
  const float* xp = args.x.data_ptr<float>();
  float* op = args.out.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kBFloat16:
      rows_kernel(xp, w.data_ptr<c10::BFloat16>(), sp, bp, rp, op, M, K, N);
      break;
    case at::kHalf:
      rows_kernel(xp, w.data_ptr<c10::Half>(), sp, bp, rp, op, M, K, N);
      break;
    case at::kChar:
      rows_kernel(xp, w.data_ptr<int8_t>(), sp, bp, rp, op, M, K, N);
      break;
    case at::kFloat:
      TORCH_CHECK(!sp, "float32 weights take no scale");
      rows_f32(xp, w.data_ptr<float>(), bp, rp, op, M, K, N);
      break;
    default:
      TORCH_CHECK(false, "rows_gemm: weights must be bfloat16, float16, int8 or float32");
  }
  return x.scalar_type() == at::kFloat ? args.out : args.out.to(x.scalar_type());
}
