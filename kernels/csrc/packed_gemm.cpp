// x @ w.T (* scale) (+ bias) (+ residual) over weights packed at load into column panels, for
// the row counts where a step is compute-bound enough that register blocking pays (a few
// rows up to a prefill chunk; rtp_serve/kernels/gemm_table.py measures where, per shape).
//
//   w [N, K] (checkpoint)  ->  panels [P = ceil(N / 16)][K][16]   (zero rows pad N to 16 P)
//
//   panel p:  k=0: w[16p .. 16p+15, 0]   k=1: w[16p .. 16p+15, 1]   ...
//
// Per k the micro-kernel loads a panel's 16 weights (two AVX2 registers, widened from bf16,
// fp16 or int8 as loaded), broadcasts x[m, k] for 6 rows of x and does 12 FMAs into 12
// accumulators: 6 x 16 outputs held in registers for the whole K loop. Threads split the
// panels (parallel over N); within a panel the rows of x go 6 at a time, so the panel comes
// from memory for the first 6 rows and from L1/L2 for the rest: every weight is read from
// memory once per call, whatever M is. The AVX-512 build runs the same AVX2 micro-kernel
// (no wider one is built: no machine here has been able to run it).
#include "gemm_args.h"
#include "tensor.h"
#include "vec.h"

#include <algorithm>

namespace {

constexpr int64_t kNR = 16;  // panel width: output columns per tile
constexpr int kMR = 6;       // rows of x per tile: 12 accumulators + 2 weights + 1 broadcast
constexpr int64_t kAhead = 16;  // k steps the panel is prefetched ahead
constexpr int64_t kKC = 128;    // k steps summed in registers before adding to the tile's sum

#ifdef RTP_AVX2
using rtp::load8;

// Rows [0, MR) of x (row stride K) times one panel, into c [MR][16]. The accumulators are
// named, not an array: GCC kept an array's copy on the stack, a store per FMA.
#define RTP_ROW(r)                                                    \
  if constexpr (MR > r) {                                             \
    const __m256 a = _mm256_broadcast_ss(x + r * K + k);              \
    lo##r = _mm256_fmadd_ps(a, b0, lo##r);                            \
    hi##r = _mm256_fmadd_ps(a, b1, hi##r);                            \
  }
#define RTP_STORE(r)                                                  \
  if constexpr (MR > r) {                                             \
    if (first) {                                                      \
      _mm256_storeu_ps(c + kNR * r, lo##r);                           \
      _mm256_storeu_ps(c + kNR * r + 8, hi##r);                       \
    } else {                                                          \
      _mm256_storeu_ps(c + kNR * r, _mm256_add_ps(_mm256_loadu_ps(c + kNR * r), lo##r)); \
      _mm256_storeu_ps(c + kNR * r + 8,                               \
                       _mm256_add_ps(_mm256_loadu_ps(c + kNR * r + 8), hi##r));          \
    }                                                                 \
  }
// Each K block of kKC steps sums into fresh registers and is then added to c: one running
// sum over all of K lost precision like a naive dot product (2.35x HF's error on smollm2's
// logits at K = 1536); blocked, the error grows with kKC + K / kKC, as MKL's does.
template <int MR, typename w_t>
RTP_INLINE void tile(const float* __restrict x, int64_t K, const w_t* __restrict b,
                     float* __restrict c) {
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t k1 = std::min(K, k0 + kKC);
    const bool first = k0 == 0;
    __m256 lo0 = _mm256_setzero_ps(), lo1 = lo0, lo2 = lo0, lo3 = lo0, lo4 = lo0, lo5 = lo0;
    __m256 hi0 = lo0, hi1 = lo0, hi2 = lo0, hi3 = lo0, hi4 = lo0, hi5 = lo0;
    for (int64_t k = k0; k < k1; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(b + kNR * (k + kAhead)), _MM_HINT_T0);
      const __m256 b0 = load8(b + kNR * k), b1 = load8(b + kNR * k + 8);
      RTP_ROW(0) RTP_ROW(1) RTP_ROW(2) RTP_ROW(3) RTP_ROW(4) RTP_ROW(5)
    }
    RTP_STORE(0) RTP_STORE(1) RTP_STORE(2) RTP_STORE(3) RTP_STORE(4) RTP_STORE(5)
  }
}
#undef RTP_ROW
#undef RTP_STORE

// Out of line, one entry per row count: inlined into the threads' loop, GCC spilled the
// accumulators.
template <typename w_t>
__attribute__((noinline)) void tile_rows(const float* x, int64_t K, const w_t* b, int64_t mr,
                                         float* c) {
  switch (mr) {
    case 6: tile<6>(x, K, b, c); break;
    case 5: tile<5>(x, K, b, c); break;
    case 4: tile<4>(x, K, b, c); break;
    case 3: tile<3>(x, K, b, c); break;
    case 2: tile<2>(x, K, b, c); break;
    default: tile<1>(x, K, b, c); break;
  }
}

template <typename w_t>
void panels_kernel(const float* x, const w_t* panels, const float* scale, const float* bias,
                   const float* residual, float* out, int64_t M, int64_t K, int64_t N) {
  const int64_t P = (N + kNR - 1) / kNR;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    alignas(32) float c[kMR * kNR];
    for (int64_t p = p0; p < p1; ++p) {
      const w_t* b = panels + p * K * kNR;
      const int64_t n0 = p * kNR, cols = std::min(kNR, N - n0);
      for (int64_t m = 0; m < M; m += kMR) {
        const int64_t mr = std::min<int64_t>(kMR, M - m);
        tile_rows(x + m * K, K, b, mr, c);
        for (int64_t r = 0; r < mr; ++r) {
          float* o = out + (m + r) * N + n0;
          const float* cr = c + r * kNR;
          const float* res = residual ? residual + (m + r) * N + n0 : nullptr;
          for (int64_t j = 0; j < cols; ++j) {
            float v = scale ? cr[j] * scale[n0 + j] : cr[j];
            if (bias) v += bias[n0 + j];
            if (res) v += res[j];
            o[j] = v;
          }
        }
      }
    }
  });
}
#endif

}  // namespace

int64_t panel_width() { return kNR; }

// x [M, K] (any float dtype), panels [P, K, 16] of float32 / bf16 / fp16 / int8 (the packing
// of w [N, K], rtp_serve/kernels/linear.py), scale [N] float32 (int8 only), bias [N] and
// residual [M, N] optional; returns [M, N] in x's dtype.
torch::Tensor packed_gemm(torch::Tensor x, torch::Tensor panels, int64_t N,
                          c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kNR,
              "x [M, K] @ panels [P, K, 16]");
  TORCH_CHECK(panels.size(1) == x.size(1), "x and panels disagree on K");
  TORCH_CHECK(N > 0 && (N + kNR - 1) / kNR == panels.size(0), "N does not match the panels");
  TORCH_CHECK(panels.is_contiguous(), "panels must be contiguous");
  const bool int8 = panels.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == scale.has_value(), "int8 weights need a scale, other dtypes none");
  const int64_t M = x.size(0), K = x.size(1);
  auto args = gemm_args(x, N, scale, bias, residual);
#ifdef RTP_AVX2
  const float* sp = ptr_or_null(args.scale);
  const float* bp = ptr_or_null(args.bias);
  const float* rp = ptr_or_null(args.residual);
  const float* xp = args.x.data_ptr<float>();
  float* op = args.out.data_ptr<float>();
  switch (panels.scalar_type()) {
    case at::kFloat:
      panels_kernel(xp, panels.data_ptr<float>(), sp, bp, rp, op, M, K, N);
      break;
    case at::kBFloat16:
      panels_kernel(xp, panels.data_ptr<c10::BFloat16>(), sp, bp, rp, op, M, K, N);
      break;
    case at::kHalf:
      panels_kernel(xp, panels.data_ptr<c10::Half>(), sp, bp, rp, op, M, K, N);
      break;
    case at::kChar:
      panels_kernel(xp, panels.data_ptr<int8_t>(), sp, bp, rp, op, M, K, N);
      break;
    default:
      TORCH_CHECK(false, "packed_gemm: panels must be float32, bfloat16, float16 or int8");
  }
#else
  TORCH_CHECK(false, "packed_gemm needs AVX2 and FMA");
#endif
  return x.scalar_type() == at::kFloat ? args.out : args.out.to(x.scalar_type());
}
