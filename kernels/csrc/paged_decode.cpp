// Paged decode attention for CPUs: one query token per sequence against its cached context,
// stored in the query's dtype or a narrower one (int8 with a scale per block and kv head),
// reading K and V in place from the block pool (no gather copy, unlike the torch reference,
// which materialises every context before attending).
//
// Work is split into tasks of (sequence, run of kv heads). A task walks its tokens in order
// and, for each token, reads the K (then V) row of all its kv heads in one contiguous
// stretch, serving every query head of each kv head's group (GQA). With enough sequences a
// task takes all heads of one sequence, so rows are streamed whole; with few sequences
// (batch 1) the heads are split so that every thread has work.
#include "parallel.h"
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

template <typename scalar_t, typename kv_t>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache,
                   const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& seq_lens, int64_t block_size, double scale,
                   const float* k_scale, const float* v_scale, torch::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const kv_t* kp = k_cache.data_ptr<kv_t>();
  const kv_t* vp = v_cache.data_ptr<kv_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t slot_stride = num_kv_heads * head_dim;
  const float fscale = static_cast<float>(scale);

  // Enough tasks for every thread (x4 for balance), but no more head splits than needed.
  const int64_t want = 4 * at::get_num_threads();
  const int64_t splits = std::min(num_kv_heads, std::max<int64_t>(1, (want + batch - 1) / batch));
  const int64_t heads_per_task = (num_kv_heads + splits - 1) / splits;
  const int64_t tasks_per_seq = (num_kv_heads + heads_per_task - 1) / heads_per_task;

  rtp::parallel_chunks(batch * tasks_per_seq, 1, [&](rtp::Chunks& chunks) {
    std::vector<float> qf, acc, scores;
    for (int64_t begin, end; chunks.next(begin, end);) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / tasks_per_seq;
        const int64_t h0 = (task % tasks_per_seq) * heads_per_task;
        const int64_t h1 = std::min(num_kv_heads, h0 + heads_per_task);
        const int64_t nq = (h1 - h0) * group;  // query heads served by this task
        const int64_t len = lens[b];
        const scalar_t* qb = qp + (b * num_heads + h0 * group) * head_dim;
        qf.resize(nq * head_dim);
        for (int64_t i = 0; i < nq * head_dim; ++i) qf[i] = static_cast<float>(qb[i]) * fscale;
        scores.resize(nq * len);

        // Pass 1: scores[h][t] = q_h . k_t.
        for (int64_t t = 0; t < len; ++t) {
          const int64_t block = bt[b * max_blocks + t / block_size];
          const int64_t slot = block * block_size + t % block_size;
          const kv_t* __restrict krow = kp + slot * slot_stride + h0 * head_dim;
          const float* ks = k_scale ? k_scale + block * num_kv_heads + h0 : nullptr;
          for (int64_t h = 0; h < nq; ++h) {
            const kv_t* __restrict kh = krow + (h / group) * head_dim;
            const float* __restrict qh = qf.data() + h * head_dim;
            float s = 0.f;
  #pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * static_cast<float>(kh[d]);
            scores[h * len + t] = ks ? s * ks[h / group] : s;
          }
        }
        // Softmax per query head.
        for (int64_t h = 0; h < nq; ++h) {
          float* sh = scores.data() + h * len;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sh[t]);
          float sum = 0.f;
          for (int64_t t = 0; t < len; ++t) {
            sh[t] = std::exp(sh[t] - mx);
            sum += sh[t];
          }
          const float inv = 1.f / sum;
          for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
        }
        // Pass 2: out_h = sum_t p[h][t] * v_t.
        acc.assign(nq * head_dim, 0.f);
        for (int64_t t = 0; t < len; ++t) {
          const int64_t block = bt[b * max_blocks + t / block_size];
          const int64_t slot = block * block_size + t % block_size;
          const kv_t* __restrict vrow = vp + slot * slot_stride + h0 * head_dim;
          const float* vs = v_scale ? v_scale + block * num_kv_heads + h0 : nullptr;
          for (int64_t h = 0; h < nq; ++h) {
            const kv_t* __restrict vh = vrow + (h / group) * head_dim;
            const float p = vs ? scores[h * len + t] * vs[h / group] : scores[h * len + t];
            float* __restrict ah = acc.data() + h * head_dim;
  #pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * static_cast<float>(vh[d]);
          }
        }
        scalar_t* ob = op + (b * num_heads + h0 * group) * head_dim;
        for (int64_t i = 0; i < nq * head_dim; ++i) ob[i] = static_cast<scalar_t>(acc[i]);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens,
                           int64_t block_size, double scale,
                           c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "expected q [B, Hq, D] and caches [slots, Hkv, D]");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "one block table and one length per sequence");
  q = q.contiguous();
  block_tables = block_tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
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
  auto out = torch::empty_like(q);
  // The cache may be stored narrower than the model computes (bf16 KV for float32 weights).
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    using q_t = scalar_t;
    switch (k_cache.scalar_type()) {
      case at::kFloat:
        decode_kernel<q_t, float>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale,
                                  ks, vs, out);
        break;
      case at::kBFloat16:
        decode_kernel<q_t, c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, block_size,
                                          scale, ks, vs, out);
        break;
      case at::kHalf:
        decode_kernel<q_t, c10::Half>(q, k_cache, v_cache, block_tables, seq_lens, block_size,
                                      scale, ks, vs, out);
        break;
      case at::kChar:
        decode_kernel<q_t, int8_t>(q, k_cache, v_cache, block_tables, seq_lens, block_size,
                                   scale, ks, vs, out);
        break;
      default:
        TORCH_CHECK(false, "paged_decode: KV cache must be float32, bfloat16, float16 or int8");
    }
  });
  return out;
}
