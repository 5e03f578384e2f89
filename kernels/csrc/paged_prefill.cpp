// Paged prefill attention for CPUs: a chunk of new tokens attends causally to a cached prefix
// plus itself, reading K and V block by block from the pool in place (the torch reference
// gathers the whole context into a contiguous copy first). The cache is stored in the
// query's dtype, a narrower float, or int8 with a scale per block and kv head.
//
//   keys:    | block 0 | block 1 | ... |   ctx_len cached  | the chunk's own n tokens |
//   query i (position ctx_len + i) sees keys 0 .. ctx_len + i
//
// A task is (tile of query rows, kv head). It widens a chunk of whole blocks of K (transposed,
// so the score loop runs over the keys) and V to float once, and serves every query head of
// the kv head's group for every row of the tile with it: an online softmax (running max,
// running sum, rescaled accumulator) over the chunks, as flash attention does. Query vectors
// go kRows at a time: their scores against the chunk's keys, then their P.V together, each V
// row loaded once for all of them; a micro-tile whose causal window ends before the chunk
// skips it. Against tiles of 64 rows and chunks of one block (AVX-512 EPYC,
// bench/attention.py, 12 heads): a new 200-token prompt 0.72 -> 0.56 ms, 1,024 tokens
// 14.7 -> 10.5 ms, 256 tokens after 1,024 cached 7.9 -> 5.8 ms.
//
// Each (tile, kv head) task widens every chunk its rows see, so a prompt cut into more tiles
// widens its first chunks more often: with tiles of 128 query vectors, widening was 15-18%
// of a new 270-token prompt's time in llama-100m (12 heads; the kernel with it left out).
// Tiles are now as large as kTileBytes and kTasksPerThread allow (one per kv head there),
// the tiles that see the most keys first: 1.05-1.08x at 270-2,048 tokens of llama-100m and
// 1.03-1.07x of smollm2 (GQA 9/3) on AVX-512, 1.03-1.05x on the AVX2 build (the same EPYC
// Zen 4, bench/kernel_ab.py --kernel paged_prefill).
#include "exp_approx.h"
#include "parallel.h"
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Query vectors (rows x the kv head's group) per task: each widened chunk serves them all, so
// the fewer tiles the fewer times each chunk is widened. A tile's queries and accumulators
// (2 x vectors x dim floats) stay within kTileBytes, and a step keeps at least
// kTasksPerThread tasks per thread, so that a thread held up by a neighbour leaves work to
// the others.
constexpr int64_t kTileBytes = 256 << 10;
constexpr int64_t kTasksPerThread = 4;

// Rows of a tile: as few tiles per kv head as both bounds allow, the rows shared out evenly.
inline int64_t tile_rows_for(int64_t n, int64_t group, int64_t dim, int64_t kv_heads) {
  const int64_t max_rows = std::max<int64_t>(1, kTileBytes / (2 * dim * 4) / group);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per_head = std::max((kTasksPerThread * threads + kv_heads - 1) / kv_heads,
                                    (n + max_rows - 1) / max_rows);
  return std::max<int64_t>(1, (n + per_head - 1) / per_head);
}

// The kernel's inner loops, for a block size and head dim fixed at compile time (kBs, kDim;
// 0 = read them at run time). Fixed sizes let the compiler keep a micro-tile of scores
// (kRows query vectors x a chunk of keys) and a query's accumulator row in registers.
constexpr int64_t kRows = 4;
// Keys per chunk, the online softmax's unit, with a fixed block size: whole blocks widened
// together. Each chunk costs every query vector two reductions (max, sum), an exp of its
// correction and a rescale of its accumulator: over 64 keys instead of one block of 16, a
// quarter as often.
constexpr int64_t kChunkKeys = 64;

template <int64_t kBs>
constexpr int64_t chunk_keys() {
  return kBs == 0 ? 0 : kBs >= kChunkKeys ? kBs : (kChunkKeys / kBs) * kBs;
}

template <int64_t kBs, int64_t kDim, typename scalar_t, typename kv_t>
void prefill_kernel(const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& block_table,
                    int64_t ctx_len, int64_t block_size, double scale, const float* k_scale,
                    const float* v_scale, torch::Tensor& out) {
  const int64_t n = q.size(0), num_heads = q.size(1);
  const int64_t dim = kDim ? kDim : q.size(2), bs = kBs ? kBs : block_size;
  constexpr int64_t kCk = chunk_keys<kBs>();
  const int64_t ck = kCk ? kCk : bs;  // keys per chunk: whole blocks
  const int64_t kv_heads = k_cache.size(1), group = num_heads / kv_heads;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const kv_t* kp = k_cache.data_ptr<kv_t>();
  const kv_t* vp = v_cache.data_ptr<kv_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t tile_rows = tile_rows_for(n, group, dim, kv_heads);
  const int64_t tiles = (n + tile_rows - 1) / tile_rows;

  rtp::parallel_chunks(tiles * kv_heads, 1, [&](rtp::Chunks& chunks) {
    std::vector<float> qf, acc, run_max, run_sum, kt(dim * ck), vf(ck * dim), s(kRows * ck);
    for (int64_t begin, end; chunks.next(begin, end);) {
      for (int64_t task = begin; task < end; ++task) {
        // The last tiles first: they see the most keys, and taken last they would leave
        // one thread finishing them alone.
        const int64_t h = task % kv_heads, tile = tiles - 1 - task / kv_heads;
        const int64_t i0 = tile * tile_rows, i1 = std::min(n, i0 + tile_rows);
        const int64_t nq = (i1 - i0) * group;  // query vectors: row-major (row, group head)
        qf.assign(((nq + kRows - 1) / kRows) * kRows * dim, 0.f);  // padded to micro-tiles
        for (int64_t i = i0; i < i1; ++i) {
          for (int64_t g = 0; g < group; ++g) {
            const scalar_t* src = qp + (i * num_heads + h * group + g) * dim;
            float* dst = qf.data() + ((i - i0) * group + g) * dim;
            for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
          }
        }
        acc.assign(((nq + kRows - 1) / kRows) * kRows * dim, 0.f);  // padded as qf
        run_max.assign(nq, -std::numeric_limits<float>::infinity());
        run_sum.assign(nq, 0.f);
        const int64_t seen = ctx_len + i1;  // keys the tile's last row sees
        for (int64_t j0 = 0; j0 < seen; j0 += ck) {
          const int64_t jn = std::min(ck, seen - j0);  // keys of this chunk
          if (jn < ck) {  // past the last key: unwritten rows may hold anything, even NaN
            std::fill(kt.begin(), kt.end(), 0.f);
            std::fill(vf.begin(), vf.end(), 0.f);
          }
          for (int64_t b0 = 0; b0 < jn; b0 += bs) {  // widen the chunk's blocks
            const int64_t phys = table[(j0 + b0) / bs], rows = std::min(bs, jn - b0);
            const float ks = k_scale ? k_scale[phys * kv_heads + h] : 1.f;
            const float vs = v_scale ? v_scale[phys * kv_heads + h] : 1.f;
            for (int64_t jj = 0; jj < rows; ++jj) {
              const int64_t j = b0 + jj;
              const kv_t* krow = kp + ((phys * bs + jj) * kv_heads + h) * dim;
              const kv_t* vrow = vp + ((phys * bs + jj) * kv_heads + h) * dim;
              float* vj = vf.data() + j * dim;
              for (int64_t d = 0; d < dim; ++d) {
                kt[d * ck + j] = static_cast<float>(krow[d]) * ks;
                vj[d] = static_cast<float>(vrow[d]) * vs;
              }
            }
          }
          for (int64_t r0 = 0; r0 < nq; r0 += kRows) {
            const int64_t last = i0 + (std::min(r0 + kRows, nq) - 1) / group;
            if (ctx_len + last < j0) continue;  // the causal windows end before the chunk
            // Scores of kRows query vectors against the chunk's keys: s[rr][j].
            float local[kRows * (kCk ? kCk : 1)];
            float* __restrict st = kCk ? local : s.data();
            for (int64_t x = 0; x < kRows * ck; ++x) st[x] = 0.f;
            for (int64_t d = 0; d < dim; ++d) {
              const float* __restrict kd = kt.data() + d * ck;
              for (int64_t rr = 0; rr < kRows; ++rr) {
                const float qd = qf[(r0 + rr) * dim + d];
  #pragma omp simd
                for (int64_t j = 0; j < ck; ++j) st[rr * ck + j] += qd * kd[j];
              }
            }
            const int64_t rows = std::min(kRows, nq - r0);
            int64_t reach = 0;  // keys of the chunk that any row of the micro-tile sees
            for (int64_t rr = 0; rr < kRows; ++rr) {
              const int64_t r = r0 + rr, i = i0 + r / group;
              float* __restrict sr = st + rr * ck;
              const int64_t vis = rr < rows ? std::min(jn, ctx_len + i + 1 - j0) : 0;
              if (vis <= 0) {  // a padding row, or its causal window ends before the chunk
                for (int64_t j = 0; j < ck; ++j) sr[j] = 0.f;
                continue;
              }
              reach = std::max(reach, vis);
              float mx = run_max[r];
              for (int64_t j = 0; j < vis; ++j) mx = std::max(mx, sr[j]);
              const float correction = rtp::exp_approx(run_max[r] - mx);
              float sum = 0.f;
  #pragma omp simd reduction(+ : sum)
              for (int64_t j = 0; j < ck; ++j) {
                const float p = j < vis ? rtp::exp_approx(sr[j] - mx) : 0.f;
                sr[j] = p;
                sum += p;
              }
              run_sum[r] = run_sum[r] * correction + sum;
              run_max[r] = mx;
              float* __restrict ar = acc.data() + r * dim;
  #pragma omp simd
              for (int64_t d = 0; d < dim; ++d) ar[d] *= correction;
            }
            // acc_r += sum_j p_rj v_j for the micro-tile's rows together: each V row is
            // loaded once for kRows rows (with the head dim fixed, their accumulators stay in
            // registers).
            float a[kDim ? kRows * kDim : 1];
            float* __restrict at = kDim ? a : acc.data() + r0 * dim;
            if (kDim) std::memcpy(a, acc.data() + r0 * dim, sizeof a);
            for (int64_t j = 0; j < reach; ++j) {
              const float* __restrict vj = vf.data() + j * dim;
              for (int64_t rr = 0; rr < kRows; ++rr) {
                const float p = st[rr * ck + j];
  #pragma omp simd
                for (int64_t d = 0; d < dim; ++d) at[rr * dim + d] += p * vj[d];
              }
            }
            if (kDim) std::memcpy(acc.data() + r0 * dim, a, sizeof a);
          }
        }
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t i = i0 + r / group, g = r % group;
          const float inv = 1.f / run_sum[r];
          scalar_t* dst = op + (i * num_heads + h * group + g) * dim;
          const float* ar = acc.data() + r * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(ar[d] * inv);
        }
      }
    }
  });
}

template <typename scalar_t, typename kv_t>
void dispatch_sizes(const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& block_table,
                    int64_t ctx_len, int64_t block_size, double scale, const float* ks,
                    const float* vs, torch::Tensor& out) {
  const int64_t dim = q.size(2);
#define RTP_PREFILL(BS, DIM) \
  prefill_kernel<BS, DIM, scalar_t, kv_t>(q, k_cache, v_cache, block_table, ctx_len, \
                                          block_size, scale, ks, vs, out)
  if (block_size == 16 && dim == 64) {
    RTP_PREFILL(16, 64);
  } else if (block_size == 16 && dim == 128) {
    RTP_PREFILL(16, 128);
  } else {
    RTP_PREFILL(0, 0);
  }
#undef RTP_PREFILL
}

}  // namespace

torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, int64_t ctx_len, int64_t block_size,
                            double scale, c10::optional<torch::Tensor> k_scale,
                            c10::optional<torch::Tensor> v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "expected q [n, Hq, D] and caches [slots, Hkv, D]");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "q and the cache must share head_dim");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.dim() == 1 &&
                  block_table.size(0) * block_size >= ctx_len + q.size(0),
              "the block table must cover ctx_len + n tokens");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()),
              "an int8 cache needs its K and V scales, and only it has them");
  const float* ks = nullptr;
  const float* vs = nullptr;
  if (int8) {
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                    k_scale->is_contiguous() && v_scale->is_contiguous() &&
                    k_scale->size(1) == k_cache.size(1),
                "scales must be contiguous float32 [blocks, kv_heads]");
    ks = k_scale->data_ptr<float>();
    vs = v_scale->data_ptr<float>();
  }
  q = q.contiguous();
  block_table = block_table.to(at::kLong).contiguous();
  auto out = torch::empty_like(q);
  if (q.size(0) == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    using q_t = scalar_t;
    switch (k_cache.scalar_type()) {
      case at::kFloat:
        dispatch_sizes<q_t, float>(q, k_cache, v_cache, block_table, ctx_len, block_size, scale,
                                   ks, vs, out);
        break;
      case at::kBFloat16:
        dispatch_sizes<q_t, c10::BFloat16>(q, k_cache, v_cache, block_table, ctx_len, block_size,
                                           scale, ks, vs, out);
        break;
      case at::kHalf:
        dispatch_sizes<q_t, c10::Half>(q, k_cache, v_cache, block_table, ctx_len, block_size,
                                       scale, ks, vs, out);
        break;
      case at::kChar:
        dispatch_sizes<q_t, int8_t>(q, k_cache, v_cache, block_table, ctx_len, block_size, scale,
                                    ks, vs, out);
        break;
      default:
        TORCH_CHECK(false, "paged_prefill: KV cache must be float32, bfloat16, float16 or int8");
    }
  });
  return out;
}
