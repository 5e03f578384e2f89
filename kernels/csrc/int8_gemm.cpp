// INT8 x INT8 -> INT32 GEMM with AVX512-VNNI (vpdpbusd), for W8A8: weights quantized per
// output channel at load, activations per row as each step runs (rtp_serve/kernels/w8a8.py).
//
//   out[m, n] = (float(sum_k xq[m, k] * wq[n, k]) * x_scale[m]) * w_scale[n] (+ bias) (+ res)
//
// The integer sums are exact, so this kernel and torch._int_mm (the reference and the
// fallback where there is no VNNI) give the same int32 for every output.
//
//   w [N, K] int8  ->  panels [P = ceil(N / 32)][K4 = ceil(K / 4)][32][4]  (zeros pad N, K)
//
// vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes per int32 lane and adds the four
// products to the lane. A panel row holds, for 32 output columns, 4 consecutive k of each:
// two registers of 16 lanes. The activations are signed: each 4-byte group of x is
// broadcast and offset by 128 (x ^ 0x80 reads x + 128 as unsigned), and the offset comes
// back out as 128 * sum_k wq[n, k] (`w_sums`, computed at load). Products fit: |sum| <=
// K * 255 * 127 < 2^31 for K < 66,000.
//
// Tiles of 12 rows x 32 columns (24 accumulators), threads over panels in chunks as
// packed_gemm.cpp; x rows must be padded to K4 * 4 bytes (w8a8.py quantizes into that).
// Only the AVX-512 build has it, compiled for VNNI in this file's functions alone (an
// AVX-512 CPU without VNNI runs the rest of the build): `int8_gemm_supported()` says whether
// this CPU can run it.
#include "parallel.h"
#include "tensor.h"
#include "vec.h"

#include <algorithm>

namespace {

#ifdef RTP_AVX512
constexpr int64_t kNR = 32;  // output columns per panel: two registers of 16 int32 lanes
constexpr int kMR = 12;      // rows of x per tile: 24 accumulators + 2 weights + 1 broadcast
// How far ahead the panel is prefetched into L2, as packed_gemm does: 48 steps of 128 bytes.
// 16 steps ahead into L1 (T0) before; this runs 3-18% faster from 1 to 64 rows of x on an
// EPYC Zen 4 (bench/kernel_ab.py: llama-100m's layer shapes, streamed from memory).
constexpr int64_t kAheadBytes = 6144;

#define RTP_VNNI __attribute__((target("avx512vnni")))

#define RTP_ROW(r)                                                              \
  if constexpr (MR > r) {                                                       \
    int32_t g;                                                                  \
    std::memcpy(&g, x + r * Kp + 4 * k, 4);                                     \
    const __m512i a = _mm512_xor_si512(_mm512_set1_epi32(g), flip);             \
    lo##r = _mm512_dpbusd_epi32(lo##r, a, b0);                                  \
    hi##r = _mm512_dpbusd_epi32(hi##r, a, b1);                                  \
  }
#define RTP_STORE(r)                                                            \
  if constexpr (MR > r) {                                                       \
    _mm512_store_si512(c + kNR * r, lo##r);                                     \
    _mm512_store_si512(c + kNR * r + 16, hi##r);                                \
  }

// Rows [0, MR) of x (row stride Kp bytes) times one panel, into c [MR][32] int32 (offset by
// 128 * the column's weight sum; the epilogue takes it out).
template <int MR>
RTP_VNNI inline __attribute__((always_inline)) void tile(const int8_t* __restrict x,
                                                         int64_t Kp, int64_t K4,
                                                         const int8_t* __restrict b,
                                                         int32_t* __restrict c) {
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  [[maybe_unused]] __m512i lo0 = _mm512_setzero_si512(), lo1 = lo0, lo2 = lo0, lo3 = lo0,
                           lo4 = lo0, lo5 = lo0, lo6 = lo0, lo7 = lo0, lo8 = lo0, lo9 = lo0,
                           lo10 = lo0, lo11 = lo0;
  [[maybe_unused]] __m512i hi0 = lo0, hi1 = lo0, hi2 = lo0, hi3 = lo0, hi4 = lo0, hi5 = lo0,
                           hi6 = lo0, hi7 = lo0, hi8 = lo0, hi9 = lo0, hi10 = lo0, hi11 = lo0;
  for (int64_t k = 0; k < K4; ++k) {
    const int8_t* row = b + k * kNR * 4;
    rtp::prefetch_l2(row + kAheadBytes);  // a panel step is 128 bytes: two lines
    rtp::prefetch_l2(row + kAheadBytes + 64);
    const __m512i b0 = _mm512_loadu_si512(row), b1 = _mm512_loadu_si512(row + 64);
    RTP_ROW(0) RTP_ROW(1) RTP_ROW(2) RTP_ROW(3) RTP_ROW(4) RTP_ROW(5)
    RTP_ROW(6) RTP_ROW(7) RTP_ROW(8) RTP_ROW(9) RTP_ROW(10) RTP_ROW(11)
  }
  RTP_STORE(0) RTP_STORE(1) RTP_STORE(2) RTP_STORE(3) RTP_STORE(4) RTP_STORE(5)
  RTP_STORE(6) RTP_STORE(7) RTP_STORE(8) RTP_STORE(9) RTP_STORE(10) RTP_STORE(11)
}
#undef RTP_ROW
#undef RTP_STORE

RTP_VNNI __attribute__((noinline)) void tile_rows(const int8_t* x, int64_t Kp, int64_t K4,
                                                  const int8_t* b, int64_t mr, int32_t* c) {
  switch (mr) {
    case 12: tile<12>(x, Kp, K4, b, c); break;
    case 11: tile<11>(x, Kp, K4, b, c); break;
    case 10: tile<10>(x, Kp, K4, b, c); break;
    case 9: tile<9>(x, Kp, K4, b, c); break;
    case 8: tile<8>(x, Kp, K4, b, c); break;
    case 7: tile<7>(x, Kp, K4, b, c); break;
    case 6: tile<6>(x, Kp, K4, b, c); break;
    case 5: tile<5>(x, Kp, K4, b, c); break;
    case 4: tile<4>(x, Kp, K4, b, c); break;
    case 3: tile<3>(x, Kp, K4, b, c); break;
    case 2: tile<2>(x, Kp, K4, b, c); break;
    default: tile<1>(x, Kp, K4, b, c); break;
  }
}

void vnni_kernel(const int8_t* x, const float* x_scale, const int8_t* panels,
                 const int32_t* w_sums, const float* w_scale, const float* bias,
                 const float* residual, float* out, int64_t M, int64_t Kp, int64_t N) {
  const int64_t K4 = Kp / 4;
  auto tile = [&](int64_t p, int64_t m, int64_t mr, int32_t* c) {
    tile_rows(x + m * Kp, Kp, K4, panels + p * K4 * kNR * 4, mr, c);
  };
  auto store = [&](int64_t row, int64_t n0, int64_t cols, const int32_t* cr) {
    float* o = out + row * N + n0;
    const float xs = x_scale[row];
    const float* res = residual ? residual + row * N + n0 : nullptr;
    for (int64_t j = 0; j < cols; ++j) {
      const int32_t dot = cr[j] - 128 * w_sums[n0 + j];
      float v = static_cast<float>(dot) * xs * w_scale[n0 + j];
      if (bias) v += bias[n0 + j];
      if (res) v += res[j];
      o[j] = v;
    }
  };
  rtp::over_panels<kMR, kNR, int32_t>(M, N, tile, store);
}
#endif

}  // namespace

bool int8_gemm_supported() {
#ifdef RTP_AVX512
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// xq [M, Kp] int8 (Kp = 4 * K4), x_scale [M] float32, panels [P, K4, 32, 4] int8, w_sums [N]
// int32, w_scale [N] float32, bias [N] and residual [M, N] optional; returns [M, N] float32.
torch::Tensor int8_gemm(torch::Tensor xq, torch::Tensor x_scale, torch::Tensor panels,
                        torch::Tensor w_sums, torch::Tensor w_scale, int64_t N,
                        c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(int8_gemm_supported(), "int8_gemm needs AVX512-VNNI");
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous(),
              "xq must be contiguous int8 [M, Kp]");
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kChar &&
                  panels.size(2) == 32 && panels.size(3) == 4 && panels.is_contiguous(),
              "panels must be contiguous int8 [P, K4, 32, 4]");
  const int64_t M = xq.size(0), Kp = xq.size(1);
  TORCH_CHECK(Kp == 4 * panels.size(1), "xq's row length must be 4 * K4 of the panels");
  TORCH_CHECK(N > 0 && (N + 31) / 32 == panels.size(0), "N does not match the panels");
  TORCH_CHECK(Kp < 66000, "K too large for exact int32 sums");
  auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const at::Tensor xs = f32(x_scale), ws = f32(w_scale);
  const at::Tensor sums = w_sums.to(at::kInt).contiguous();
  TORCH_CHECK(xs.numel() == M, "x_scale must be [M]");
  TORCH_CHECK(ws.numel() == N && sums.numel() == N, "w_scale and w_sums must be [N]");
  at::Tensor b, res;
  if (bias.has_value()) {
    b = f32(*bias);
    TORCH_CHECK(b.numel() == N, "bias must be [N]");
  }
  if (residual.has_value()) {
    res = f32(*residual);
    TORCH_CHECK(res.dim() == 2 && res.size(0) == M && res.size(1) == N, "residual must be [M, N]");
  }
  at::Tensor out = at::empty({M, N}, xq.options().dtype(at::kFloat));
#ifdef RTP_AVX512
  vnni_kernel(xq.data_ptr<int8_t>(), xs.data_ptr<float>(), panels.data_ptr<int8_t>(),
              sums.data_ptr<int32_t>(), ws.data_ptr<float>(),
              b.defined() ? b.data_ptr<float>() : nullptr,
              res.defined() ? res.data_ptr<float>() : nullptr, out.data_ptr<float>(), M, Kp, N);
#endif
  return out;
}
