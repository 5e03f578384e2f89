// Writes new K or V rows into the int8 KV cache, adapting each block's per-head scale
// (kernels/kv_quant.py has the scheme and the torch reference this matches).
//
// The tokens of a step are cut into runs of consecutive tokens that land in one block. A task
// is (run, kv head): it decides the block's new scale from the old one (none if the run
// starts the block at offset 0) and the run's largest |value|, requantizes the block's earlier
// rows if the scale grew, and quantizes the run's rows. Runs of one step never share a block,
// so tasks never touch the same bytes.
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr float kQmax = 127.f;

inline int8_t quantize(float x, float inv) {
  return static_cast<int8_t>(std::max(-kQmax, std::min(kQmax, std::nearbyint(x * inv))));
}

template <typename scalar_t>
void write_kernel(const torch::Tensor& x, torch::Tensor& cache, torch::Tensor& scales,
                  const torch::Tensor& slot_mapping, int64_t block_size) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  int8_t* cp = cache.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();

  std::vector<int64_t> run_start;  // first token of each run; a sentinel closes the last
  for (int64_t t = 0; t < tokens; ++t) {
    if (t == 0 || slots[t] / block_size != slots[t - 1] / block_size) run_start.push_back(t);
  }
  run_start.push_back(tokens);
  const int64_t runs = static_cast<int64_t>(run_start.size()) - 1;
  const int64_t row = heads * dim;

  at::parallel_for(0, runs * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / heads, h = task % heads;
      const int64_t t0 = run_start[r], t1 = run_start[r + 1];
      const int64_t block = slots[t0] / block_size, first_offset = slots[t0] % block_size;
      float amax = 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* xr = xp + t * row + h * dim;
        for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::abs(static_cast<float>(xr[d])));
      }
      float& scale = sp[block * heads + h];
      const float old = first_offset > 0 ? scale : 0.f;
      const float updated = std::max(old, amax * (1.f / kQmax));  // as the reference rounds
      if (old > 0.f && updated > old) {  // earlier rows of the block, to the new scale
        const float ratio = old / updated;
        for (int64_t o = 0; o < first_offset; ++o) {
          int8_t* cr = cp + (block * block_size + o) * row + h * dim;
          for (int64_t d = 0; d < dim; ++d) cr[d] = quantize(static_cast<float>(cr[d]), ratio);
        }
      }
      scale = updated;
      const float inv = updated > 0.f ? 1.f / updated : 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* xr = xp + t * row + h * dim;
        int8_t* cr = cp + slots[t] * row + h * dim;
        for (int64_t d = 0; d < dim; ++d) cr[d] = quantize(static_cast<float>(xr[d]), inv);
      }
    }
  });
}

}  // namespace

void kv_write_int8(torch::Tensor cache, torch::Tensor scales, torch::Tensor x,
                   torch::Tensor slot_mapping, int64_t block_size) {
  TORCH_CHECK(cache.scalar_type() == at::kChar && cache.is_contiguous(),
              "kv_write_int8: the cache must be a contiguous int8 tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "kv_write_int8: scales must be a contiguous float32 tensor");
  TORCH_CHECK(x.dim() == 3 && cache.dim() == 3 && x.size(1) == cache.size(1) &&
                  x.size(2) == cache.size(2) && scales.size(1) == cache.size(1),
              "kv_write_int8: expected x [T, H, D], cache [S, H, D], scales [blocks, H]");
  TORCH_CHECK(slot_mapping.size(0) == x.size(0), "kv_write_int8: one slot per row");
  x = x.contiguous();
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kv_write_int8", [&] {
    write_kernel<scalar_t>(x, cache, scales, slot_mapping, block_size);
  });
}
