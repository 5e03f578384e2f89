// The LoRA updates of a step's decode rows, each row with its own adapter, in one call:
//
//     y[i] += (x[i] A_s^T) B_s      s = row_slot[i] (-1: the base model, no update)
//
// over every resident adapter's A and B stacked (engine/lora/stacked.py, "rows" layout):
//
//   a       [C, in]  one row per column of the low-rank activations t (a rank of one adapter's
//                    part: q, k or v of a fused qkv), that column's A row
//   col_slot [C]     the adapter slot each column belongs to
//   b       flat     each column's B row, b[b_off[c] : + b_len[c]], added into output columns
//                    [b_col0[c], b_col0[c] + b_len[c]) (its part's columns)
//
// A decode step is bound by the bytes it reads, and the masked GEMMs over every adapter
// (the torch path) read all of them and multiply every row by every adapter. Here rows that
// share an adapter are taken together, so each adapter's A and B are read once, and only by
// the rows that use them: the work is the rows' own updates and nothing else.
#include "tensor.h"

#include <algorithm>
#include <map>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * x[i];
  return s;
}

inline void axpy(float t, const float* __restrict b, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += t * b[i];
}

struct Group {
  std::vector<int64_t> rows;  // rows of x / y
  std::vector<int64_t> cols;  // columns of t (rows of a) of this adapter
};

}  // namespace

void lora_rows(torch::Tensor x, torch::Tensor y, torch::Tensor row_slot, torch::Tensor a,
               torch::Tensor col_slot, torch::Tensor b, torch::Tensor b_off,
               torch::Tensor b_col0, torch::Tensor b_len) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 2 && x.size(0) == y.size(0) &&
                  x.size(1) == a.size(1),
              "lora_rows: x [T, in], y [T, out], a [C, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                  a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat,
              "lora_rows: float32 only");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(),
              "lora_rows: rows must be contiguous");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), C = a.size(0);
  for (auto* t : {&row_slot, &col_slot, &b_off, &b_col0, &b_len}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "lora_rows: int64 indices");
  }
  TORCH_CHECK(row_slot.numel() == T, "lora_rows: a slot per row");
  TORCH_CHECK(col_slot.numel() == C && b_off.numel() == C && b_col0.numel() == C &&
                  b_len.numel() == C,
              "lora_rows: a slot, offset, first column and length per column of t");
  const int64_t* rs = row_slot.data_ptr<int64_t>();
  const int64_t* cs = col_slot.data_ptr<int64_t>();
  const int64_t* off = b_off.data_ptr<int64_t>();
  const int64_t* col0 = b_col0.data_ptr<int64_t>();
  const int64_t* len = b_len.data_ptr<int64_t>();
  for (int64_t c = 0; c < C; ++c) {
    TORCH_CHECK(col0[c] >= 0 && len[c] >= 0 && col0[c] + len[c] <= N && off[c] >= 0 &&
                    off[c] + len[c] <= b.numel(),
                "lora_rows: column ", c, " writes or reads out of bounds");
  }

  std::map<int64_t, Group> by_slot;  // ordered: a stable order of work
  for (int64_t i = 0; i < T; ++i) {
    if (rs[i] >= 0) by_slot[rs[i]].rows.push_back(i);
  }
  for (int64_t c = 0; c < C; ++c) {
    auto it = by_slot.find(cs[c]);
    if (it != by_slot.end()) it->second.cols.push_back(c);
  }
  std::vector<const Group*> groups;
  for (auto& [slot, g] : by_slot) {
    if (!g.cols.empty()) groups.push_back(&g);
  }
  if (groups.empty()) return;

  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0);

  // t of a group: [rows, cols of its adapter]; shrink over a range of its columns.
  auto shrink = [&](const Group& g, float* t, int64_t j0, int64_t j1) {
    const int64_t nc = static_cast<int64_t>(g.cols.size());
    for (int64_t j = j0; j < j1; ++j) {
      const float* arow = ap + g.cols[j] * K;
      for (size_t r = 0; r < g.rows.size(); ++r) t[r * nc + j] = dot(arow, xp + g.rows[r] * xs, K);
    }
  };
  // y of a group's rows += t B, for the output columns [o0, o1) only.
  auto expand = [&](const Group& g, const float* t, int64_t o0, int64_t o1) {
    const int64_t nc = static_cast<int64_t>(g.cols.size());
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t c = g.cols[j];
      const int64_t lo = std::max(o0, col0[c]), hi = std::min(o1, col0[c] + len[c]);
      if (lo >= hi) continue;
      const float* brow = bp + off[c] + (lo - col0[c]);
      for (size_t r = 0; r < g.rows.size(); ++r) {
        axpy(t[r * nc + j], brow, yp + g.rows[r] * ys + lo, hi - lo);
      }
    }
  };

  const int64_t threads = at::get_num_threads();
  if (static_cast<int64_t>(groups.size()) >= threads) {
    // Enough adapters to go round: each thread takes whole groups (distinct rows of y).
    at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t g0, int64_t g1) {
      std::vector<float> t;
      for (int64_t gi = g0; gi < g1; ++gi) {
        const Group& g = *groups[gi];
        t.assign(g.rows.size() * g.cols.size(), 0.f);
        shrink(g, t.data(), 0, static_cast<int64_t>(g.cols.size()));
        expand(g, t.data(), 0, N);
      }
    });
    return;
  }
  // Fewer adapters than threads: each group's columns of t, then its output columns, split.
  for (const Group* g : groups) {
    const int64_t nc = static_cast<int64_t>(g->cols.size());
    std::vector<float> t(g->rows.size() * nc, 0.f);
    at::parallel_for(0, nc, 1, [&](int64_t j0, int64_t j1) { shrink(*g, t.data(), j0, j1); });
    at::parallel_for(0, N, 256, [&](int64_t o0, int64_t o1) { expand(*g, t.data(), o0, o1); });
  }
}
