// Paged decode attention for CPUs: one query token per sequence against its cached context,
// stored in the query's dtype or a narrower one (int8 with a scale per block and kv head),
// reading K and V in place from the block pool (no gather copy, unlike the torch reference,
// which materialises every context before attending).
//
// Work is split into tasks of (sequence, run of whole blocks). A task walks its tokens in
// order and, for each token, reads the K (then V) row of all kv heads in one contiguous
// stretch, serving every query head (GQA groups included). With enough sequences a task is a
// whole sequence and writes its output; with few (batch 1 to 4 on two threads) each
// sequence's tokens are split into runs, every task keeps its run's softmax partial (max,
// sum, unnormalised output) and a second pass merges them (split-KV, as flash-decoding).
// Splitting tokens, not heads, keeps every thread's reads whole rows: when two cores read
// alternate halves of the same rows (the split by heads before), batch 4 on 2 threads read
// 12-14 GB/s where whole rows read 25-30 (an EPYC Zen 4; most likely each core's
// prefetcher pulled in the other's half as well).
//
// For an int8 cache whose head dim is a whole number of vectors (kLanes floats), both passes
// run on vectors: pass 1 scores kLanes tokens at a time for each query head and reduces
// their dot products together (rtp::vsum_each) instead of a horizontal sum per (token,
// head); pass 2 keeps each query head's accumulator in registers over a tile of tokens.
// smollm2 (GQA 9/3) with bf16 weights and int8 KV, a decode step of 48 rows on two threads
// (AVX-512 EPYC): attention 22-25 -> 16.5 ms a step (bench/attention.py decode 48: 0.84 ->
// 0.50 ms a layer). A float32 or bf16 cache gained nothing so, or lost (float32 KV under
// float32 queries: 19.6 -> 22.3 ms a step; bf16 under bf16: the same), and keeps the scalar
// loops: their rows stream token by token, the vector pass reads 16 rows' stripes at once.
#include "exp_approx.h"
#include "parallel.h"
#include "tensor.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// A run of tokens no shorter than this is worth a task of its own (and a merge).
constexpr int64_t kMinRunTokens = 64;

#ifdef RTP_AVX2
using rtp::kLanes;
using rtp::VecF;

// Pass 1 with vectors, over an int8 cache (its K scales per block and kv head) whose head
// dim is a multiple of kLanes: the scores of kLanes tokens at a time (`slot`: the run's
// slots, padded to whole groups), each query head's dot products with them accumulated
// lane-wise and reduced together (rtp::vsum_each). scores[h * ld + t].
template <typename kv_t>
void scores_vec(const float* qf, const kv_t* kp, const int64_t* slot, const int64_t* blk,
                int64_t n_pad, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                const float* k_scale, float* scores, int64_t ld) {
  const int64_t slot_stride = num_kv_heads * head_dim;
  for (int64_t t = 0; t < n_pad; t += kLanes) {
    for (int64_t g = 0, h = 0; g < num_kv_heads; ++g) {
      const kv_t* rows[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) rows[i] = kp + slot[t + i] * slot_stride + g * head_dim;
      float k_sc[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) k_sc[i] = k_scale[blk[t + i] * num_kv_heads + g];
      for (int64_t j = 0; j < group; ++j, ++h) {
        const float* qh = qf + h * head_dim;
        VecF acc[kLanes];
        for (int64_t i = 0; i < kLanes; ++i) acc[i] = rtp::vzero();
        for (int64_t d = 0; d < head_dim; d += kLanes) {
          const VecF qv = rtp::vload(qh + d);
#pragma GCC unroll 16
          for (int64_t i = 0; i < kLanes; ++i) acc[i] = rtp::vfma(qv, rtp::vloadw(rows[i] + d), acc[i]);
        }
        rtp::vstore(scores + h * ld + t, rtp::vmul(rtp::vsum_each(acc), rtp::vload(k_sc)));
      }
    }
  }
}

// Pass 2 with vectors: out[0 .. kVecs * kLanes) += sum over tokens [t0, t1) of e[t] * v_t
// (scaled by its block's V scale), the accumulator in registers (two sets, even and odd
// tokens, for independent chains).
template <int kVecs, typename kv_t>
RTP_INLINE void weighted_rows(const float* e, const kv_t* vp, const int64_t* slot,
                              const int64_t* blk, int64_t t0, int64_t t1, int64_t slot_stride,
                              int64_t off, int64_t num_kv_heads, int64_t g,
                              const float* v_scale, float* out) {
  VecF a[kVecs], b[kVecs];
  for (int k = 0; k < kVecs; ++k) a[k] = rtp::vload(out + k * kLanes), b[k] = rtp::vzero();
  const auto weight = [&](int64_t t) {
    const float p = e[t] * v_scale[blk[t] * num_kv_heads + g];
    return rtp::vset1(&p);
  };
  int64_t t = t0;
  for (; t + 2 <= t1; t += 2) {
    const VecF p0 = weight(t), p1 = weight(t + 1);
    const kv_t* r0 = vp + slot[t] * slot_stride + off;
    const kv_t* r1 = vp + slot[t + 1] * slot_stride + off;
    for (int k = 0; k < kVecs; ++k) {
      a[k] = rtp::vfma(p0, rtp::vloadw(r0 + k * kLanes), a[k]);
      b[k] = rtp::vfma(p1, rtp::vloadw(r1 + k * kLanes), b[k]);
    }
  }
  if (t < t1) {
    const VecF p0 = weight(t);
    const kv_t* r0 = vp + slot[t] * slot_stride + off;
    for (int k = 0; k < kVecs; ++k) a[k] = rtp::vfma(p0, rtp::vloadw(r0 + k * kLanes), a[k]);
  }
  for (int k = 0; k < kVecs; ++k) rtp::vstore(out + k * kLanes, rtp::vadd(a[k], b[k]));
}

// Tokens per tile of pass 2: each tile's V rows are read from memory once, in order, and
// serve every query head from the cache. Head by head over the whole run instead read an
// MHA model's rows a head's stripe at a time (12% slower over a bf16 cache of 48 rows,
// blocks scattered, when bf16 took these passes too).
constexpr int64_t kTileTokens = 16;

template <typename kv_t>
void weighted_sum_vec(const float* scores, int64_t ld, const kv_t* vp, const int64_t* slot,
                      const int64_t* blk, int64_t n, int64_t num_kv_heads, int64_t group,
                      int64_t head_dim, const float* v_scale, float* acc) {
  const int64_t slot_stride = num_kv_heads * head_dim;
  for (int64_t t0 = 0; t0 < n; t0 += kTileTokens) {
    const int64_t t1 = std::min(n, t0 + kTileTokens);
    for (int64_t g = 0, h = 0; g < num_kv_heads; ++g) {
      for (int64_t j = 0; j < group; ++j, ++h) {
        const float* e = scores + h * ld;
        int64_t d = 0;
        for (; d + 4 * kLanes <= head_dim; d += 4 * kLanes)
          weighted_rows<4>(e, vp, slot, blk, t0, t1, slot_stride, g * head_dim + d,
                           num_kv_heads, g, v_scale, acc + h * head_dim + d);
        for (; d < head_dim; d += kLanes)
          weighted_rows<1>(e, vp, slot, blk, t0, t1, slot_stride, g * head_dim + d,
                           num_kv_heads, g, v_scale, acc + h * head_dim + d);
      }
    }
  }
}
#endif

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
  const int64_t row_bytes = slot_stride * static_cast<int64_t>(sizeof(kv_t));
  const float fscale = static_cast<float>(scale);

  // Enough tasks for every thread (x4, so that the others take a stalled thread's share),
  // in runs of whole blocks no shorter than kMinRunTokens.
  const int64_t max_len = *std::max_element(lens, lens + batch);
  const int64_t want = 4 * at::get_num_threads();
  const int64_t want_runs = std::max<int64_t>(1, (want + batch - 1) / batch);
  int64_t run = std::max(kMinRunTokens, (max_len + want_runs - 1) / want_runs);
  run = (run + block_size - 1) / block_size * block_size;
  const int64_t runs = std::max<int64_t>(1, (max_len + run - 1) / run);

  // Each run's partial, per (sequence, run, query head): its max score, its sum of
  // exp(score - max), and its output weighted by those, not yet divided by the sum.
  std::vector<float> part_max, part_sum, part_acc;
  if (runs > 1) {
    part_max.assign(batch * runs * num_heads, -std::numeric_limits<float>::infinity());
    part_sum.assign(batch * runs * num_heads, 0.f);
    part_acc.assign(batch * runs * num_heads * head_dim, 0.f);
  }

  rtp::parallel_chunks(batch * runs, 1, [&](rtp::Chunks& chunks) {
    std::vector<float> qf(num_heads * head_dim), acc, scores, mx(num_heads), sum(num_heads);
    std::vector<int64_t> slot, blk;  // the run's slots and blocks (the vector passes)
    for (int64_t begin, end; chunks.next(begin, end);) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / runs, r = task % runs;
        const int64_t t0 = r * run, t1 = std::min(lens[b], t0 + run), n = t1 - t0;
        if (n <= 0) continue;  // a shorter sequence: its partial stays empty
        // fn(t, block, slot) for each token t of [from, to) of sequence b, in order, its row
        // of `rows` (the K or the V cache) read by fn. Where the sequence's next block is
        // not the one after this in the pool (blocks freed and taken again in another
        // order), each row read asks for the row a block further on in L2 (its lines, a T1
        // hint each), so the next block is on its way before the walk jumps there: left to
        // the hardware prefetcher, the walk stalled at each jump. bench/attention.py
        // "decode 48 scattered" on an EPYC Zen 4, ms a layer: smollm2's heads (9/3)
        // float32 1.42-1.57 -> 0.87-0.95 and bf16 1.04 -> 0.78 (in order: 0.74-0.78 and
        // 0.65-0.69); llama-100m's (12/12) bf16 2.1-2.3 -> 1.5-1.7, float32 2.4-2.9 ->
        // 2.6-2.8. Blocks in order are left to the hardware: asking for them too cost up to
        // 30% (llama-100m float32 decode 48).
        const auto for_each_slot = [&](const kv_t* rows, int64_t from, int64_t to,
                                       const auto& fn) {
          for (int64_t t = from; t < to;) {
            const int64_t block = bt[b * max_blocks + t / block_size];
            const int64_t off = t % block_size, count = std::min(block_size - off, to - t);
            const int64_t ahead = t - off + block_size;  // the next block's first token
            const int64_t next_block = ahead < to ? bt[b * max_blocks + ahead / block_size] : -1;
            const kv_t* next = rows != nullptr && next_block >= 0 && next_block != block + 1
                ? rows + next_block * block_size * slot_stride
                : nullptr;
            for (int64_t i = 0; i < count; ++i, ++t) {
#ifdef RTP_AVX2
              if (next != nullptr) {
                const char* line = reinterpret_cast<const char*>(next + (off + i) * slot_stride);
                for (int64_t byte = 0; byte < row_bytes; byte += 64) rtp::prefetch_l2(line + byte);
              }
#endif
              fn(t, block, block * block_size + off + i);
            }
          }
        };
        const scalar_t* qb = qp + b * num_heads * head_dim;
        for (int64_t i = 0; i < num_heads * head_dim; ++i)
          qf[i] = static_cast<float>(qb[i]) * fscale;
#ifdef RTP_AVX2
        const bool vec = head_dim % kLanes == 0 && std::is_same_v<kv_t, int8_t>;
#else
        const bool vec = false;
#endif
        // Scores are [head][token], rows of `ld`: the run padded to whole vectors for `vec`.
        const int64_t ld = vec ? (n + kLanes - 1) / kLanes * kLanes : n;
        scores.resize(num_heads * ld);
#ifdef RTP_AVX2
        if (vec) {
          slot.resize(ld);
          blk.resize(ld);
          for_each_slot(nullptr, t0, t1, [&](int64_t t, int64_t block, int64_t sl) {
            slot[t - t0] = sl;
            blk[t - t0] = block;
          });
          for (int64_t i = n; i < ld; ++i) slot[i] = slot[0], blk[i] = blk[0];  // never counted
          scores_vec(qf.data(), kp, slot.data(), blk.data(), ld, num_kv_heads, group, head_dim,
                     k_scale, scores.data(), ld);
        }
#endif

        // Pass 1: scores[h][t] = q_h . k_t, walking the run block by block (query head h
        // reads kv head h / group: the loops go kv head, then its group, with no division).
        if (!vec) for_each_slot(kp, t0, t1, [&](int64_t t, int64_t block, int64_t slot) {
          const kv_t* __restrict krow = kp + slot * slot_stride;
          const float* ks = k_scale ? k_scale + block * num_kv_heads : nullptr;
          for (int64_t g = 0, h = 0; g < num_kv_heads; ++g) {
            const kv_t* __restrict kh = krow + g * head_dim;
            const float k_sc = ks ? ks[g] : 1.f;
            for (int64_t j = 0; j < group; ++j, ++h) {
              const float* __restrict qh = qf.data() + h * head_dim;
              float s = 0.f;
#pragma omp simd reduction(+ : s)
              for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * static_cast<float>(kh[d]);
              scores[h * ld + (t - t0)] = ks ? s * k_sc : s;
            }
          }
        });
        // Softmax numerators per query head: exp(score - the run's max).
        for (int64_t h = 0; h < num_heads; ++h) {
          float* __restrict sh = scores.data() + h * ld;
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) m = std::max(m, sh[t]);
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t t = 0; t < n; ++t) {
            sh[t] = rtp::exp_approx(sh[t] - m);
            s += sh[t];
          }
          mx[h] = m;
          sum[h] = s;
        }
        // Pass 2: acc_h = sum_t e[h][t] * v_t.
        acc.assign(num_heads * head_dim, 0.f);
#ifdef RTP_AVX2
        if (vec)
          weighted_sum_vec(scores.data(), ld, vp, slot.data(), blk.data(), n, num_kv_heads, group,
                           head_dim, v_scale, acc.data());
#endif
        if (!vec) for_each_slot(vp, t0, t1, [&](int64_t t, int64_t block, int64_t slot) {
          const kv_t* __restrict vrow = vp + slot * slot_stride;
          const float* vs = v_scale ? v_scale + block * num_kv_heads : nullptr;
          for (int64_t g = 0, h = 0; g < num_kv_heads; ++g) {
            const kv_t* __restrict vh = vrow + g * head_dim;
            for (int64_t j = 0; j < group; ++j, ++h) {
              const float e = scores[h * ld + (t - t0)];
              const float p = vs ? e * vs[g] : e;
              float* __restrict ah = acc.data() + h * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * static_cast<float>(vh[d]);
            }
          }
        });
        if (runs == 1) {
          scalar_t* ob = op + b * num_heads * head_dim;
          for (int64_t h = 0; h < num_heads; ++h) {
            const float inv = 1.f / sum[h];
            for (int64_t d = 0; d < head_dim; ++d)
              ob[h * head_dim + d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv);
          }
        } else {
          const int64_t p0 = (b * runs + r) * num_heads;
          std::copy(mx.begin(), mx.end(), part_max.begin() + p0);
          std::copy(sum.begin(), sum.end(), part_sum.begin() + p0);
          std::copy(acc.begin(), acc.end(), part_acc.begin() + p0 * head_dim);
        }
      }
    }
  });
  if (runs == 1) return;

  // Merge each (sequence, query head)'s runs: rescale each to the common max.
  const int64_t rows = batch * num_heads;
  rtp::parallel_chunks(rows, rtp::chunk_for(rows), [&](rtp::Chunks& chunks) {
    std::vector<float> o(head_dim);
    for (int64_t begin, end; chunks.next(begin, end);) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / num_heads, h = bh % num_heads;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t r = 0; r < runs; ++r)
          m = std::max(m, part_max[(b * runs + r) * num_heads + h]);
        float total = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t r = 0; r < runs; ++r) {
          const int64_t p = (b * runs + r) * num_heads + h;
          if (part_sum[p] == 0.f) continue;  // an empty run
          const float w = rtp::exp_approx(part_max[p] - m);
          total += part_sum[p] * w;
          const float* __restrict a = part_acc.data() + p * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / total;
        scalar_t* ob = op + bh * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) ob[d] = static_cast<scalar_t>(o[d] * inv);
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
