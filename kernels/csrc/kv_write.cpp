// Writes a step's new K and V rows into a float32, bf16 or fp16 KV cache, in one call for
// both (the int8 cache has kv_quant.cpp). Each token's row of all kv heads is one contiguous
// stretch in the cache and in the source ([T, Hkv, D] with any token stride: k and v are
// column slices of the QKV projection's output), so a row is a copy, or a conversion where
// the cache is narrower than the model computes.
//
// torch's index_copy_, which this replaces, took about 45 us per call for the 48 rows of a
// decode step of llama-100m (two calls a layer: 1.1 ms of an 80 ms step with the pool
// mapped): it sets up a TensorIterator and wakes the thread pool for 150 KB. A decode step's
// rows are copied by the calling thread; a prefill chunk's are split among the threads.
#include "parallel.h"
#include "tensor.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace {

// Rows at which a write is worth the thread pool's wake-up (a row of llama-100m is 3 KiB).
constexpr int64_t kParallelRows = 256;

template <typename src_t, typename kv_t>
void write_rows(const torch::Tensor& x, torch::Tensor& cache, const int64_t* slots) {
  const int64_t tokens = x.size(0), row = x.size(1) * x.size(2), stride = x.stride(0);
  const src_t* xp = x.data_ptr<src_t>();
  kv_t* cp = cache.data_ptr<kv_t>();
  const auto copy = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const src_t* __restrict from = xp + t * stride;
      kv_t* __restrict to = cp + slots[t] * row;
      if constexpr (std::is_same_v<src_t, kv_t>) {
        std::memcpy(to, from, row * sizeof(kv_t));
      } else {
        for (int64_t i = 0; i < row; ++i) to[i] = static_cast<kv_t>(static_cast<float>(from[i]));
      }
    }
  };
  if (tokens < kParallelRows) {
    copy(0, tokens);
    return;
  }
  rtp::parallel_chunks(tokens, rtp::chunk_for(tokens), [&](rtp::Chunks& chunks) {
    for (int64_t begin, end; chunks.next(begin, end);) copy(begin, end);
  });
}

template <typename kv_t>
void write_cache(const torch::Tensor& x, torch::Tensor& cache, const int64_t* slots) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kv_write", [&] {
    write_rows<scalar_t, kv_t>(x, cache, slots);
  });
}

void write_one(const char* name, const torch::Tensor& x, torch::Tensor& cache,
               const int64_t* slots) {
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous(), "kv_write: the ", name,
              " cache must be contiguous [slots, H, D]");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == cache.size(1) && x.size(2) == cache.size(2),
              "kv_write: ", name, " rows must be [T, H, D] as the cache's");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2),
              "kv_write: each of the ", name, " rows must be contiguous");
  switch (cache.scalar_type()) {
    case at::kFloat:
      write_cache<float>(x, cache, slots);
      break;
    case at::kBFloat16:
      write_cache<c10::BFloat16>(x, cache, slots);
      break;
    case at::kHalf:
      write_cache<c10::Half>(x, cache, slots);
      break;
    default:
      TORCH_CHECK(false, "kv_write: the cache must be float32, bfloat16 or float16 (int8 has "
                         "kv_write_int8)");
  }
}

}  // namespace

// k, v [T, Hkv, D] (each token's row contiguous) into k_cache, v_cache [slots, Hkv, D] at
// slot_mapping [T]: cache[slot_mapping[t]] = row t, converted to the cache's dtype.
void kv_write(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                  k.size(0) == v.size(0),
              "kv_write: one slot per row of k and of v");
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0);
  TORCH_CHECK(v_cache.size(0) == capacity, "kv_write: K and V caches of different sizes");
  for (int64_t t = 0; t < slot_mapping.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, "kv_write: slot ", slots[t],
                " outside the cache's ", capacity);
  write_one("K", k, k_cache, slots);
  write_one("V", v, v_cache, slots);
}
