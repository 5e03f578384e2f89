// x @ w.T (* scale) (+ bias) (+ residual) over weights packed at load into column panels, for
// the row counts where a step is compute-bound enough that register blocking pays (a few
// rows up to a prefill chunk; rtp_serve/kernels/gemm_table.py measures where, per shape).
//
//   w [N, K] (checkpoint)  ->  panels [P = ceil(N / NR)][K][NR]   (zero rows pad N to NR P)
//
//   panel p:  k=0: w[NR p .. NR p + NR-1, 0]   k=1: w[NR p .., 1]   ...
//
// NR is two float32 registers of the build: 16 columns on AVX2, 32 on AVX-512
// (panel_width(); the loader packs to it). Per k the micro-kernel loads a panel's NR weights
// (two registers, widened from bf16, fp16 or int8 as loaded), broadcasts x[m, k] for MR rows
// of x and does 2 MR FMAs into 2 MR accumulators: MR x NR outputs held in registers for a
// block of K. MR is 6 on AVX2 (12 accumulators of its 16 registers) and 12 on AVX-512 (24 of
// 32). Threads take the panels in chunks, in turn (parallel over N, parallel.h); within a panel
// the rows of x go MR at a time, so the panel comes from memory for the first MR rows and from
// L1/L2 for the rest: every weight is read from memory once per call, whatever M is.
#include "gemm_args.h"
#include "parallel.h"
#include "tensor.h"
#include "vec.h"

#include <algorithm>

namespace {

#ifdef RTP_AVX2
using rtp::kLanes;
using rtp::VecF;
constexpr int64_t kNR = 2 * kLanes;  // panel width: output columns per tile
#ifdef RTP_AVX512
constexpr int kMR = 12;  // rows of x per tile: 24 accumulators + 2 weights + 1 broadcast
#else
constexpr int kMR = 6;   // rows of x per tile: 12 accumulators + 2 weights + 1 broadcast
#endif
// How far ahead of the tile the panel is prefetched, in bytes, into L2 (a T1 hint): 6 KiB.
// Streaming a panel from memory (a few rows of x: decode), 16 k steps ahead into L1 (T0)
// read 25-27 GB/s on an EPYC Zen 4; 6 KiB ahead into L2 gave 4-17% more GFLOPS from 1 to 12
// rows and about 1% at 16-64, where only the first tile streams (bench/kernel_ab.py).
constexpr int64_t kAheadBytes = 6144;
constexpr int64_t kKC = 128;    // k steps summed in registers before adding to the tile's sum

// Rows [0, MR) of x (row stride K) times one panel, into c [MR][NR]. The accumulators are
// named, not an array: GCC kept an array's copy on the stack, a store per FMA.
#define RTP_ROW(r)                                                    \
  if constexpr (MR > r) {                                             \
    const VecF a = rtp::vset1(x + r * K + k);                         \
    lo##r = rtp::vfma(a, b0, lo##r);                                  \
    hi##r = rtp::vfma(a, b1, hi##r);                                  \
  }
#define RTP_STORE(r)                                                  \
  if constexpr (MR > r) {                                             \
    float* cr = c + kNR * r;                                          \
    rtp::vstore(cr, first ? lo##r : rtp::vadd(rtp::vload(cr), lo##r));             \
    rtp::vstore(cr + kLanes, first ? hi##r : rtp::vadd(rtp::vload(cr + kLanes), hi##r)); \
  }
// Each K block of kKC steps sums into fresh registers and is then added to c: one running
// sum over all of K lost precision like a naive dot product (2.35x HF's error on smollm2's
// logits at K = 1536); blocked, the error grows with kKC + K / kKC, as MKL's does.
template <int MR, typename w_t>
RTP_INLINE void tile(const float* __restrict x, int64_t K, const w_t* __restrict b,
                     float* __restrict c) {
  constexpr int64_t line = 64 / static_cast<int64_t>(sizeof(w_t));  // weights per cache line
  constexpr int64_t ahead = kAheadBytes / (kNR * static_cast<int64_t>(sizeof(w_t)));  // k steps
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t k1 = std::min(K, k0 + kKC);
    const bool first = k0 == 0;
    [[maybe_unused]] VecF lo0 = rtp::vzero(), lo1 = lo0, lo2 = lo0, lo3 = lo0, lo4 = lo0,
                          lo5 = lo0, lo6 = lo0, lo7 = lo0, lo8 = lo0, lo9 = lo0, lo10 = lo0,
                          lo11 = lo0;
    [[maybe_unused]] VecF hi0 = lo0, hi1 = lo0, hi2 = lo0, hi3 = lo0, hi4 = lo0, hi5 = lo0,
                          hi6 = lo0, hi7 = lo0, hi8 = lo0, hi9 = lo0, hi10 = lo0, hi11 = lo0;
    for (int64_t k = k0; k < k1; ++k) {
      for (int64_t j = 0; j < kNR; j += line)  // unrolled: a panel row is 1 or 2 lines
        rtp::prefetch_l2(b + kNR * (k + ahead) + j);
      const VecF b0 = rtp::vloadw(b + kNR * k), b1 = rtp::vloadw(b + kNR * k + kLanes);
      RTP_ROW(0) RTP_ROW(1) RTP_ROW(2) RTP_ROW(3) RTP_ROW(4) RTP_ROW(5)
      RTP_ROW(6) RTP_ROW(7) RTP_ROW(8) RTP_ROW(9) RTP_ROW(10) RTP_ROW(11)
    }
    RTP_STORE(0) RTP_STORE(1) RTP_STORE(2) RTP_STORE(3) RTP_STORE(4) RTP_STORE(5)
    RTP_STORE(6) RTP_STORE(7) RTP_STORE(8) RTP_STORE(9) RTP_STORE(10) RTP_STORE(11)
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
#ifdef RTP_AVX512
    case 12: tile<12>(x, K, b, c); break;
    case 11: tile<11>(x, K, b, c); break;
    case 10: tile<10>(x, K, b, c); break;
    case 9: tile<9>(x, K, b, c); break;
    case 8: tile<8>(x, K, b, c); break;
    case 7: tile<7>(x, K, b, c); break;
#endif
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
  auto tile = [&](int64_t p, int64_t m, int64_t mr, float* c) {
    tile_rows(x + m * K, K, panels + p * K * kNR, mr, c);
  };
  auto store = [&](int64_t row, int64_t n0, int64_t cols, const float* cr) {
    float* o = out + row * N + n0;
    const float* res = residual ? residual + row * N + n0 : nullptr;
    for (int64_t j = 0; j < cols; ++j) {
      float v = scale ? cr[j] * scale[n0 + j] : cr[j];
      if (bias) v += bias[n0 + j];
      if (res) v += res[j];
      o[j] = v;
    }
  };
  rtp::over_panels<kMR, kNR, float>(M, N, tile, store);
}
#endif

}  // namespace

int64_t panel_width() {
#ifdef RTP_AVX2
  return kNR;
#else
  return 16;  // the AVX2 layout; nothing here computes on it without AVX2
#endif
}

// x [M, K] (any float dtype), panels [P, K, panel_width()] of float32 / bf16 / fp16 / int8
// (the packing of w [N, K], rtp_serve/kernels/linear.py), scale [N] float32 (int8 only),
// bias [N] and residual [M, N] optional; returns [M, N] in x's dtype.
torch::Tensor packed_gemm(torch::Tensor x, torch::Tensor panels, int64_t N,
                          c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> residual) {
  const int64_t NR = panel_width();
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == NR,
              "x [M, K] @ panels [P, K, ", NR, "]");
  TORCH_CHECK(panels.size(1) == x.size(1), "x and panels disagree on K");
  TORCH_CHECK(N > 0 && (N + NR - 1) / NR == panels.size(0), "N does not match the panels");
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
